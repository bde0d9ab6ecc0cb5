"""Overlapped steps (engine.overlap_steps): a decode step scheduled and launched while the one
before it still runs, its input tokens read from that step's sampled ids, gives the tokens of
steps run one after another: requests ending in flight (length, stop ids, stop strings),
arrivals, aborts, seeded sampling, and every page back at the end."""

from __future__ import annotations

import asyncio
import importlib.util
import random

import pytest

from yaied import LLM, SamplingParams
from yaied.core.config import load_config
from yaied.core.request import FinishReason
from yaied.engine.async_engine import AsyncEngine
from yaied.worker.model_files import DEFAULT_MODEL_NAME, DEFAULT_MODEL_PACKAGE


def _llm(model: str, overlap: str, **overrides) -> LLM:
    return LLM(
        model, dtype="float32", overlap_steps=overlap, max_num_seqs=6, kv_cache_gib=0.02,
        show_progress=False, **overrides,
    )  # fmt: skip


def _pages_all_back(llm: LLM) -> bool:
    engine = llm.engine
    pool, tree = engine.pool, engine.cache.tree
    return pool.num_free + tree.num_cached_pages == pool.num_pages and not engine.scheduler.running


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def pair(request, tiny_model_dirs):
    folder = str(tiny_model_dirs[request.param])
    plain, overlapped = _llm(folder, "off"), _llm(folder, "on")
    yield plain, overlapped
    plain.close()
    overlapped.close()


def _requests(vocab: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(3, 40))] for _ in range(14)]
    params = [
        SamplingParams(max_tokens=rng.randint(1, 24), temperature=0.0, ignore_eos=True)
        for _ in prompts
    ]
    return prompts, params


def test_greedy_tokens_are_the_same_with_requests_ending_in_flight(pair):
    plain, overlapped = pair
    assert not plain.engine.overlap_steps and overlapped.engine.overlap_steps
    prompts, params = _requests(plain.vocab_size, seed=0)
    reference = plain.generate(prompts, params)
    # Half the requests now stop on a token they produce midway: they end while the step after
    # is already on the device. 14 requests over 6 seats: arrivals stop the overlap in between.
    for i, out in enumerate(reference):
        if i % 2 == 0 and len(out.token_ids) > 3:
            params[i] = SamplingParams(
                max_tokens=params[i].max_tokens, temperature=0.0,
                stop_token_ids=[out.token_ids[len(out.token_ids) // 2]],
            )  # fmt: skip
    expected = plain.generate(prompts, params)
    before = overlapped.stats()["num_steps_ahead"]
    got = overlapped.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in expected]
    assert FinishReason.STOP in {o.finish_reason for o in got}
    assert overlapped.stats()["num_steps_ahead"] > before  # it did overlap
    assert _pages_all_back(overlapped)


def test_seeded_sampling_draws_the_same_tokens(pair):
    """A seeded draw hashes (seed, output tokens so far): the step ahead must count the token
    still in flight."""
    plain, overlapped = pair
    prompts, params = _requests(plain.vocab_size, seed=1)
    params = [
        SamplingParams(max_tokens=p.max_tokens, temperature=1.0, top_p=0.9, seed=i, ignore_eos=True)
        for i, p in enumerate(params)
    ]
    expected = plain.generate(prompts, params)
    got = overlapped.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]


def test_a_step_ahead_that_fails_to_launch_is_scheduled_again_as_usual(pair):
    plain, overlapped = pair
    prompts, params = _requests(plain.vocab_size, seed=2)
    expected = plain.generate(prompts, params)
    failed = [0]

    def hook(batch):
        if batch.previous_rows is not None and failed[0] < 3:
            failed[0] += 1
            raise RuntimeError("the launch failed")

    engine = overlapped.engine
    restarts = dict(engine.restarts)
    engine.worker.fault_hook = hook
    try:
        got = overlapped.generate(prompts, params)
    finally:
        engine.worker.fault_hook = None
    assert failed[0] == 3
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert engine.restarts == restarts and _pages_all_back(overlapped)


def test_aborts_while_a_step_is_ahead_free_every_page(tiny_model_dirs):
    config = load_config(
        overrides={
            "model": str(tiny_model_dirs["llama"]),
            "dtype": "float32",
            "kv_cache_gib": 0.01,
            "overlap_steps": "on",
        }
    )
    engine = AsyncEngine(config, show_progress=False)

    async def run(prompt: list[int], stop_after: int | None) -> int:
        stream = engine.generate(prompt, max_tokens=40, temperature=0.0, ignore_eos=True)
        got = 0
        async for event in stream:
            got += len(event.token_ids)
            if stop_after is not None and got >= stop_after:
                break
        await stream.aclose()
        return got

    async def main() -> list[int]:
        prompts = [list(range(1 + i, 20 + i)) for i in range(5)]
        counts = await asyncio.gather(
            *(run(p, 3 + 4 * i if i % 2 else None) for i, p in enumerate(prompts))
        )
        for _ in range(100):  # the aborts land between steps
            if not engine.scheduler.has_work:
                break
            await asyncio.sleep(0.01)
        return counts

    try:
        counts = asyncio.run(main())
        assert counts[0] == counts[2] == counts[4] == 40
        assert engine.num_steps_ahead > 0
        pool, tree = engine.pool, engine.cache.tree
        assert pool.num_free + tree.num_cached_pages == pool.num_pages
        assert engine.restarts == dict.fromkeys(engine.restarts, 0)  # no invariant broke
    finally:
        engine._executor.shutdown()


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec(DEFAULT_MODEL_PACKAGE) is None,  # located, never imported
    reason="needs the default model (a tokenizer for stop strings)",
)
def test_stop_strings_on_the_default_model_end_the_same_way():
    """Stop strings are found in the text after the step: the row ahead is wasted, and the
    tokens after the stop string are dropped as without overlap."""
    plain = LLM(DEFAULT_MODEL_NAME, dtype="float32", overlap_steps="off", show_progress=False)
    overlapped = LLM(DEFAULT_MODEL_NAME, dtype="float32", overlap_steps="on", show_progress=False)
    try:
        prompts = ["The three primary colours are", "Write a haiku about the sea.", "1, 2, 3,"]
        free = plain.generate(prompts, max_tokens=24, temperature=0.0, ignore_eos=True)
        stops = [out.text[len(out.text) // 2 :][:3] for out in free]
        params = [SamplingParams(max_tokens=24, temperature=0.0, stop=[stop]) for stop in stops]
        expected = plain.generate(prompts, params)
        got = overlapped.generate(prompts, params)
        assert [(o.text, o.finish_reason) for o in got] == [
            (o.text, o.finish_reason) for o in expected
        ]
        assert overlapped.stats()["num_steps_ahead"] > 0
    finally:
        plain.close()
        overlapped.close()
