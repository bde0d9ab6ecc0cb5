"""The synchronous Python API (yaied/llm.py): what is not a prompt, its use after close()."""

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


def test_what_is_not_a_prompt_is_a_clear_type_error(tiny_model_dirs):
    from yaied import LLM

    with LLM(str(tiny_model_dirs["llama"]), kv_cache_gib=0.01, show_progress=False) as llm:
        for bad in (None, 123, 1.5):
            with pytest.raises(TypeError, match="prompts must be a string, a token-id list"):
                llm.generate(bad, max_tokens=1)
        with pytest.raises(ValueError, match="prompt must be a string or a list of token ids"):
            llm.generate([None], max_tokens=1)
        assert llm.generate([], max_tokens=1) == []
        assert len(llm.generate([[1, 2, 3]], max_tokens=1)) == 1  # still serving
