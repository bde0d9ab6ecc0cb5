"""On CUDA: the Triton path with CUDA graphs keeps greedy parity with transformers (fp32, ieee
dots), alone and in batches with chunked prefill and prefix hits; bf16 serves a batch."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import assert_greedy_equal, hf_greedy
from yaied import LLM, SamplingParams

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(600)]
NEW_TOKENS = 24


def prompts_with_shared_prefixes(vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    base = [rng.randrange(vocab) for _ in range(100)]
    fresh = [[rng.randrange(vocab) for _ in range(rng.randint(3, 120))] for _ in range(12)]
    return fresh + [base[: rng.randint(40, 100)] + [rng.randrange(vocab)] for _ in range(6)]


def cuda_llm(folder, dtype: str, **overrides) -> LLM:
    return LLM(
        str(folder),
        dtype=dtype,
        device="cuda",
        gpu_memory_utilization=0.3,
        max_num_batched_tokens=64,  # chunked prefill, chunks mixed with decodes
        max_num_seqs=16,
        show_progress=False,
        **overrides,
    )


@pytest.mark.parametrize("kind", ["llama3-scaled", "qwen3", "qwen2"])
def test_cuda_greedy_matches_transformers(tiny_model_dirs, kind):
    folder = tiny_model_dirs[kind]
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    with cuda_llm(folder, "float32") as llm:
        assert llm.engine.worker.runner.graphs is not None
        prompts = prompts_with_shared_prefixes(llm.vocab_size, seed=3)
        batched = llm.generate(prompts, params)
        alone = llm.generate([prompts[0]], params)[0]  # batch 1 runs the size-1 graph
        assert alone.token_ids == batched[0].token_ids
        assert llm.stats()["prefix_cache_hits"] > 0
    for prompt, out in zip(prompts, batched, strict=True):
        expected = hf_greedy(reference, prompt, NEW_TOKENS)
        assert_greedy_equal(reference, prompt, out.token_ids, expected)


def test_graphs_and_eager_give_the_same_tokens(tiny_model_dirs):
    folder = tiny_model_dirs["qwen3"]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = []
    for graphs in (True, False):
        with cuda_llm(folder, "float32", cuda_graphs=graphs) as llm:
            prompts = prompts_with_shared_prefixes(llm.vocab_size, seed=4)
            outputs.append([o.token_ids for o in llm.generate(prompts, params)])
    assert outputs[0] == outputs[1]


def test_bf16_serves_a_batch(tiny_model_dirs):
    folder = tiny_model_dirs["llama"]
    params = SamplingParams(max_tokens=40, temperature=0.8, seed=1, ignore_eos=True)
    with cuda_llm(folder, "auto") as llm:
        assert llm.engine.info.dtype == "bfloat16"
        outputs = llm.generate(prompts_with_shared_prefixes(llm.vocab_size, seed=5), params)
        assert all(len(o.token_ids) == 40 and o.error is None for o in outputs)
        stats = llm.stats()
        assert stats["num_free_pages"] == stats["num_pages"]
