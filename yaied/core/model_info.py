"""One description of a loaded model, as every layer sees it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """Found at start-up (never written back into config). The router's front end validates
    requests against the first two; the rest describe one engine's KV pool and are 0 or "" where
    unknown (a remote engine reports only its context length)."""

    max_model_len: int
    vocab_size: int
    num_pages: int = 0
    page_size: int = 0
    dtype: str = ""
    device: str = ""
