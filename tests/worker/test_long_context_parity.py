"""Thousands of positions against transformers fp32, on a tiny model whose context is 4096: prompt
logprobs and greedy output through chunks of several sizes (not page-aligned, and the whole prompt
in one), a prefix-cache hit part-way into a prompt, and a prompt that fills the context."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import _TINY_BASE, assert_greedy_equal, hf_greedy, make_tiny_model
from yaied import LLM, SamplingParams

CONTEXT = 4096
CONFIGS = {
    "long": dict(
        _TINY_BASE,
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        max_position_embeddings=CONTEXT,
    )
}
NEW_TOKENS = 8
TOL = 1e-3  # as tests/worker/test_logprobs.py


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model("long", tmp_path_factory.mktemp("long") / "long", configs=CONFIGS)


@pytest.fixture(scope="module")
def reference(folder):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def prompt_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(length)]


def check_prompt_logprobs(reference, prompt: list[int], entries) -> None:
    with torch.no_grad():
        expected = torch.log_softmax(reference(torch.tensor([prompt])).logits[0], -1)
    assert entries[0] is None
    got = torch.tensor([e.logprob for e in entries[1:]])
    want = expected[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    torch.testing.assert_close(got, want, atol=TOL, rtol=0.0)


@pytest.mark.parametrize("budget", [200, 700, CONTEXT])
def test_a_long_prompt_in_chunks_of_any_size_matches_transformers(folder, reference, budget):
    prompt = prompt_of(3000, seed=1)
    params = SamplingParams(
        max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, prompt_logprobs=0
    )
    with LLM(
        str(folder), dtype="float32", max_num_batched_tokens=budget, show_progress=False
    ) as llm:
        out = llm.generate([prompt], params)[0]
    check_prompt_logprobs(reference, prompt, out.prompt_logprobs)
    assert_greedy_equal(reference, prompt, out.token_ids, hf_greedy(reference, prompt, NEW_TOKENS))


def test_a_prefix_hit_part_way_and_a_full_context_match_transformers(folder, reference):
    first = prompt_of(3000, seed=2)
    shared = first[:2000] + prompt_of(1000, seed=3)  # 2000: not a whole number of pages
    full = prompt_of(CONTEXT - 1, seed=4)
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(str(folder), dtype="float32", max_num_batched_tokens=512, show_progress=False) as llm:
        llm.generate([first], greedy)
        hit = llm.generate([shared], greedy)[0]
        last = llm.generate([full], SamplingParams(max_tokens=1, temperature=0.0))[0]
        # The context is full: one more token is refused before anything runs.
        with pytest.raises(ValueError, match="context length"):
            llm.generate([full], SamplingParams(max_tokens=2, temperature=0.0))
        assert llm.stats()["num_free_pages"] == llm.stats()["num_pages"]
    assert hit.num_cached_tokens == 2000 // 16 * 16
    expected = hf_greedy(reference, shared, NEW_TOKENS)
    assert_greedy_equal(reference, shared, hit.token_ids, expected)
    assert_greedy_equal(reference, full, last.token_ids, hf_greedy(reference, full, 1))
    assert last.finish_reason == "length"
