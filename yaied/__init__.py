"""yaied: an OpenAI-compatible, streaming-first LLM serving engine and daemon."""

from __future__ import annotations

from typing import TYPE_CHECKING

from yaied.core.request import FinishReason, RequestOutput, SamplingParams, TokenEvent

if TYPE_CHECKING:
    from yaied.engine.async_engine import AsyncEngine
    from yaied.llm import LLM

__all__ = ["LLM", "AsyncEngine", "FinishReason", "RequestOutput", "SamplingParams", "TokenEvent"]


def __getattr__(name: str):
    # Import the engine lazily: `import yaied` for the request types must not load torch.
    if name == "LLM":
        from yaied.llm import LLM

        return LLM
    if name == "AsyncEngine":
        from yaied.engine.async_engine import AsyncEngine

        return AsyncEngine
    raise AttributeError(f"module 'yaied' has no attribute {name!r}")
