"""Embeddings through the engine: a pooling request runs its prompt in the normal batches (in
chunks, beside others), returns its pooled final hidden state in its one event, decodes
nothing, and gives its pages back at once. Checked against transformers' hidden states."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.engine.test_async_engine import all_pages_free
from yaied.core.request import SamplingParams
from yaied.engine.async_engine import AsyncEngine

PROMPT = [(7 * i + 3) % 250 + 1 for i in range(70)]  # over two 32-token chunks


@pytest.fixture(scope="module")
def reference(tiny_model_dirs):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["llama"], dtype=torch.float32)

    def hidden(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model.model(torch.tensor([prompt])).last_hidden_state[0]  # [len, hidden]

    return hidden


async def embed(engine: AsyncEngine, prompt: list[int], pooling: str):
    params = SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling)
    return [event async for event in engine.generate(prompt, params)]


@pytest.mark.parametrize("pooling", ["mean", "last"])
async def test_pooled_states_match_transformers(engine, reference, pooling):
    events = await embed(engine, PROMPT, pooling)
    assert len(events) == 1 and events[0].finished and events[0].token_ids == []
    rows = reference(PROMPT)
    expected = rows.mean(dim=0) if pooling == "mean" else rows[-1]
    got = torch.tensor(events[0].embedding)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert events[0].num_prompt_tokens == len(PROMPT) and events[0].text == ""
    assert all_pages_free(engine)


async def test_mean_pooling_ignores_the_prefix_cache(engine, reference):
    """A generation caches the prompt's pages first; the mean still covers every row."""
    async for _ in engine.generate(PROMPT, max_tokens=2, temperature=0.0):
        pass
    events = await embed(engine, PROMPT, "mean")
    got = torch.tensor(events[0].embedding)
    torch.testing.assert_close(got, reference(PROMPT).mean(dim=0), rtol=1e-4, atol=1e-4)


async def test_many_embeddings_batch_beside_a_generation(engine, reference):
    prompts = [[(i * 13 + j) % 250 + 1 for j in range(5 + i % 7)] for i in range(24)]

    async def generation():
        return [e async for e in engine.generate([1, 2, 3], max_tokens=8, ignore_eos=True)]

    results = await asyncio.gather(generation(), *(embed(engine, p, "last") for p in prompts))
    assert sum(len(e.token_ids) for e in results[0]) == 8
    for prompt, events in zip(prompts, results[1:], strict=True):
        torch.testing.assert_close(
            torch.tensor(events[0].embedding), reference(prompt)[-1], rtol=1e-4, atol=1e-4
        )
    assert all_pages_free(engine)


def test_pooling_is_checked():
    with pytest.raises(ValueError, match="pooling"):
        SamplingParams(max_tokens=1, pooling="max")
    with pytest.raises(ValueError, match="max_tokens must be 1"):
        SamplingParams(max_tokens=2, pooling="mean")
