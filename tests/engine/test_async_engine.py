"""The engine loop: streaming, aborts, bad input, worker failures, stop conditions."""

from __future__ import annotations

import asyncio

import pytest

from yaied import SamplingParams
from yaied.core.request import FinishReason
from yaied.engine.async_engine import AsyncEngine


def all_pages_free(engine: AsyncEngine) -> bool:
    """No request holds a page: each is free or cached and unused (evictable)."""
    pool, tree = engine.pool, engine.cache.tree
    nothing_leaked = pool.num_free + tree.num_cached_pages == pool.num_pages
    return nothing_leaked and engine.cache.num_free_pages == pool.num_pages


async def collect(engine, prompt, **kwargs):
    return [e async for e in engine.generate(prompt, **kwargs)]


async def test_stream_ends_with_one_final_event(engine):
    events = await collect(engine, [1, 2, 3, 4, 5], max_tokens=7, temperature=0.0, ignore_eos=True)
    assert [e.finished for e in events] == [False] * 6 + [True]
    assert events[-1].finish_reason is FinishReason.LENGTH
    assert sum(len(e.token_ids) for e in events) == 7
    assert events[-1].num_prompt_tokens == 5 and events[-1].num_output_tokens == 7
    assert all_pages_free(engine)


async def test_closing_the_stream_aborts_and_frees_pages(engine):
    stream = engine.generate(list(range(1, 60)), max_tokens=200, temperature=0.0, ignore_eos=True)
    got = 0
    async for _ in stream:
        got += 1
        if got == 3:
            break
    await stream.aclose()
    for _ in range(50):
        if all_pages_free(engine) and not engine.scheduler.has_work:
            break
        await asyncio.sleep(0.01)
    assert all_pages_free(engine)
    # the engine keeps serving
    events = await collect(engine, [3, 4], max_tokens=2, temperature=0.0, ignore_eos=True)
    assert events[-1].finish_reason is FinishReason.LENGTH


async def test_abort_by_id_sends_a_final_abort_event(engine):
    started = asyncio.Event()

    async def consume():
        events = []
        stream = engine.generate(
            [5] * 20, request_id="r-abort", max_tokens=500, temperature=0.0, ignore_eos=True
        )
        async for event in stream:
            events.append(event)
            started.set()  # the request is in the engine: the abort has something to stop
        return events

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), 10)
    engine.abort("r-abort")
    events = await asyncio.wait_for(task, 10)
    assert events[-1].finish_reason is FinishReason.ABORT
    assert all_pages_free(engine)


async def test_stop_token_ids_and_seeded_batch_mix(engine):
    first = await collect(engine, [9, 8, 7], max_tokens=5, temperature=0.0, ignore_eos=True)
    tokens = [t for e in first for t in e.token_ids]
    stop_at = tokens[2]
    events = await collect(
        engine, [9, 8, 7], max_tokens=5, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_at]
    )
    out = [t for e in events for t in e.token_ids]
    assert out == tokens[: tokens.index(stop_at) + 1]
    assert events[-1].finish_reason is FinishReason.STOP and events[-1].stop_reason == stop_at


async def test_random_sampling_runs_beside_greedy(engine):
    params = [dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05), dict(temperature=0.0)]
    results = await asyncio.gather(
        *(collect(engine, [1, 2, 3], max_tokens=6, ignore_eos=True, **p) for p in params)
    )
    sampled, greedy = ([t for e in r for t in e.token_ids] for r in results)
    assert len(sampled) == 6
    # The sampled row beside it changes nothing of the greedy row's tokens.
    alone = await collect(engine, [1, 2, 3], max_tokens=6, ignore_eos=True, temperature=0.0)
    assert greedy == [t for e in alone for t in e.token_ids]


async def test_stats_report_every_name_in_the_table(engine):
    """The server and a router read core/metric_names.py; the engine must report those keys (the
    KV usage the server derives from num_free_pages / num_pages)."""
    from yaied.core.metric_names import ENGINE_COUNTERS, ENGINE_GAUGES

    stats = engine.stats()
    assert {*ENGINE_COUNTERS, *ENGINE_GAUGES} - {"kv_cache_usage_perc"} <= stats.keys()
    assert {"num_free_pages", "num_pages"} <= stats.keys()


@pytest.mark.parametrize(
    "prompt, kwargs, message",
    [
        ([], {}, "empty"),
        ([1, 2], {"max_tokens": 0}, "max_tokens"),
        ([1, 2], {"top_p": 0.0}, "top_p"),
        ([1, 2], {"top_p": 1.5}, "top_p"),
        ([1, 2], {"temperature": -1.0}, "temperature"),
        ([1, 2], {"bogus": 1}, "unknown"),
        ([1, 10**6], {}, "token ids"),
        ([1, 2], {"max_tokens": 10**6}, "context length"),
        ("text", {}, "tokenizer"),  # the tiny model has no tokenizer
    ],
)
async def test_bad_input_raises_before_queueing(engine, prompt, kwargs, message):
    with pytest.raises(ValueError, match=message):
        await collect(engine, prompt, **kwargs)
    assert not engine.scheduler.has_work


async def test_worker_exception_fails_that_step_only(engine):
    def explode(batch):
        engine.worker.fault_hook = None  # fail exactly one step
        raise RuntimeError("injected")

    engine.worker.fault_hook = explode
    events = await collect(engine, [1, 2, 3], max_tokens=4, temperature=0.0, ignore_eos=True)
    assert events[-1].finish_reason is FinishReason.ERROR and "injected" in events[-1].error
    assert all_pages_free(engine)
    events = await collect(engine, [1, 2, 3], max_tokens=4, temperature=0.0, ignore_eos=True)
    assert events[-1].finish_reason is FinishReason.LENGTH


def test_sampling_params_reject_unknown_keyword():
    with pytest.raises(ValueError, match="unknown sampling parameter"):
        SamplingParams.from_kwargs(temprature=0.5)


async def test_seeded_sampling_ignores_batch_company(engine):
    """The same seed gives the same tokens alone and beside other requests."""
    seeded = dict(max_tokens=8, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)

    def tokens(events):
        return [t for e in events for t in e.token_ids]

    alone = tokens(await collect(engine, [4, 5, 6], **seeded))
    crowd = await asyncio.gather(
        collect(engine, [7, 8], max_tokens=8, temperature=1.0, ignore_eos=True),
        collect(engine, [4, 5, 6], **seeded),
        collect(engine, [9] * 30, max_tokens=5, temperature=0.7, ignore_eos=True),
    )
    assert tokens(crowd[1]) == alone
    unseeded = {
        tuple(
            tokens(await collect(engine, [4, 5, 6], max_tokens=8, temperature=1.0, ignore_eos=True))
        )
        for _ in range(3)
    }
    assert len(unseeded) > 1  # without a seed, draws differ


async def test_logprobs_reach_the_events(engine):
    events = await collect(
        engine,
        [1, 2, 3, 4],
        max_tokens=3,
        temperature=0.0,
        ignore_eos=True,
        logprobs=2,
        prompt_logprobs=1,
    )
    assert [len(e.logprobs) for e in events] == [1, 1, 1]
    first = events[0].logprobs[0]
    assert first.token_id == events[0].token_ids[0] and len(first.top_ids) == 2
    assert first.logprob == pytest.approx(first.top_logprobs[0])  # greedy took the top token
    prompt = events[0].prompt_logprobs
    assert prompt[0] is None and [p.token_id for p in prompt[1:]] == [2, 3, 4]
    assert all(e.prompt_logprobs is None for e in events[1:])


async def test_min_tokens_holds_off_stop_token_ids(engine):
    first = await collect(engine, [9, 8, 7], max_tokens=6, temperature=0.0, ignore_eos=True)
    stop_at = first[0].token_ids[0]
    events = await collect(
        engine,
        [9, 8, 7],
        max_tokens=6,
        temperature=0.0,
        ignore_eos=True,
        stop_token_ids=[stop_at],
        min_tokens=3,
    )
    out = [t for e in events for t in e.token_ids]
    assert len(out) >= 3 and stop_at not in out[:3]


async def test_events_carry_the_queue_time(engine):
    events = await collect(engine, [1, 2, 3], max_tokens=2, temperature=0.0, ignore_eos=True)
    assert all(e.queue_time is not None and 0 <= e.queue_time < 5 for e in events)
