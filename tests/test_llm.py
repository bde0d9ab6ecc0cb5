"""The synchronous Python API (yaied/llm.py): its use after close()."""

from __future__ import annotations

import pytest


def test_generate_after_close_says_so(tiny_model_dirs):
    # It failed with asyncio's "Event loop is closed" and a never-awaited coroutine warning.
    from yaied import LLM

    llm = LLM(str(tiny_model_dirs["llama"]), kv_cache_gib=0.01, show_progress=False)
    llm.close()
    llm.close()  # twice is fine
    with pytest.raises(RuntimeError, match="this LLM is closed"):
        llm.generate([1, 2, 3], max_tokens=1)
