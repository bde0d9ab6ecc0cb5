"""Greedy output is unchanged by prefix-cache hits, chunked prefill over a cached prefix and
preemption: every request still equals transformers' own greedy continuation."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import assert_greedy_equal, hf_greedy
from yaied import LLM, SamplingParams

NEW_TOKENS = 16
PARAMS = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_model_dirs):
    folder = tiny_model_dirs["qwen2"]
    return folder, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def shared_prefix_prompts(seed: int) -> list[list[int]]:
    """Three groups of prompts; each group shares a 40..70-token prefix."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(3):
        prefix = [rng.randrange(256) for _ in range(rng.randint(40, 70))]
        prompts += [
            prefix + [rng.randrange(256) for _ in range(rng.randint(1, 20))] for _ in range(4)
        ]
    return prompts


def check_all(model, prompts, outputs, new_tokens=NEW_TOKENS):
    for prompt, out in zip(prompts, outputs, strict=True):
        assert_greedy_equal(model, prompt, out.token_ids, hf_greedy(model, prompt, new_tokens))


def test_prefix_hits_and_chunks_over_cached_prefixes(reference):
    folder, model = reference
    prompts = shared_prefix_prompts(seed=11)
    with LLM(
        str(folder),
        dtype="float32",
        kv_cache_gib=0.01,
        max_num_batched_tokens=24,
        show_progress=False,
    ) as llm:
        first = llm.generate(prompts, PARAMS)
        again = llm.generate(prompts, PARAMS)  # now nearly everything is a cache hit
        stats = llm.stats()
    assert stats["prefix_cache_hits"] > 0
    assert all(out.num_cached_tokens > 0 for out in again)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    check_all(model, prompts, first)


def test_preemption_keeps_greedy_output(reference):
    folder, model = reference
    rng = random.Random(12)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(90, 110))] for _ in range(14)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    # Tiny qwen2: 2 layers x 2 kv heads x 16 dims x 2 (K, V) x 4 bytes = 512 B a token, 8 KiB a
    # page. 66 pages hold one full 1024-token context, but not 14 requests of ~9 pages at once.
    pages = 66
    with LLM(
        str(folder),
        dtype="float32",
        kv_cache_gib=pages * 8192 / 2**30,
        max_num_batched_tokens=128,
        show_progress=False,
    ) as llm:
        assert llm.stats()["num_pages"] == pages
        outputs = llm.generate(prompts, params)
        stats = llm.stats()
    assert stats["num_preemptions"] > 0
    assert stats["num_free_pages"] == stats["num_pages"]
    check_all(model, prompts, outputs, new_tokens=40)


def test_disabled_prefix_cache_gives_the_same_tokens(reference):
    folder, _ = reference
    prompts = shared_prefix_prompts(seed=13)
    outputs = []
    for enabled in (True, False):
        with LLM(
            str(folder),
            dtype="float32",
            kv_cache_gib=0.01,
            show_progress=False,
            enable_prefix_caching=enabled,
        ) as llm:
            outputs.append([o.token_ids for o in llm.generate(prompts + prompts, PARAMS)])
            assert (llm.stats()["prefix_cache_hits"] > 0) == enabled
    assert outputs[0] == outputs[1]
