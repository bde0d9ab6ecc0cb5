"""The embedded default model (9 attention heads, 3 KV heads) at TP=3 on CPU: prompt logprobs
equal TP=1's within 1e-3 in fp32, and greedy outputs are equal. Three ranks oversubscribe a
small machine, so the prompt and the output are kept short."""

from __future__ import annotations

import pytest

from yaied import LLM, SamplingParams


@pytest.mark.slow  # the real default model, loaded at TP=1 and as three shards
@pytest.mark.timeout(600)
def test_default_model_at_tp3_equals_tp1(default_model_folder):
    prompts = [[1, 504, 3458, 282, 4649, 314, 2051, 30, 1456], [1, 9519, 28, 940, 314]]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    results = {}
    for tp in (1, 3):
        with LLM(
            str(default_model_folder),
            dtype="float32",
            tensor_parallel_size=tp,
            kv_cache_gib=0.02,
            max_model_len=256,
            show_progress=False,
        ) as llm:
            results[tp] = llm.generate(prompts, params)
    for one, three in zip(results[1], results[3], strict=True):
        assert three.token_ids == one.token_ids
        for x, y in zip(one.prompt_logprobs[1:], three.prompt_logprobs[1:], strict=True):
            assert y.logprob == pytest.approx(x.logprob, abs=1e-3)
            assert y.top_logprobs == pytest.approx(x.top_logprobs, abs=1e-3)
