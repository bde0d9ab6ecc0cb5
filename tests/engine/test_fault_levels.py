"""The engine's escalation order (yaied/engine/faults.py), one injected fault per level.

The engine is stepped synchronously (add_request + step), so each fault lands exactly where the
test puts it. Level 1 ends one request; level 2 fails the in-flight requests and rebuilds the
bookkeeping; level 3 stops the engine for good.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import pytest
import torch

from yaied.cache.radix_cache import TreeNode
from yaied.core.config import load_config
from yaied.core.request import FinishReason, TokenEvent
from yaied.core.stream import EventStream
from yaied.engine.async_engine import AsyncEngine
from yaied.engine.faults import EngineDeadError, InvariantError, check_invariants
from yaied.engine.output import RequestStream

PLAIN = dict(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture
def engine(tiny_model_dirs):
    config = load_config(
        env={},
        overrides={
            "model": str(tiny_model_dirs["llama"]),
            "dtype": "float32",
            "kv_cache_gib": 0.01,
            "max_num_batched_tokens": 16,
            "threads": 1,
        },
    )
    eng = AsyncEngine(config, show_progress=False)
    yield eng
    eng._executor.shutdown(wait=False)


@dataclass(slots=True)
class Submitted:
    live: RequestStream  # the engine's own record of the request
    events: EventStream

    @property
    def request(self):
        return self.live.request


def submit(engine: AsyncEngine, prompt: list[int], request_id: str | None = None, **sampling):
    """Validate as every caller does (engine.inputs), then queue with a stream to read."""
    params = engine.inputs.sampling_params(None, sampling)
    ids = engine.inputs.prompt_token_ids(prompt, params)
    events: EventStream[None] = EventStream()
    rid = engine.add_request(ids, params, sink=events.sink(None), request_id=request_id)
    return Submitted(engine._streams[rid], events)


def events(submitted: Submitted) -> list[TokenEvent]:
    return [event for _, event in submitted.events.drain()]


def run(engine: AsyncEngine, max_steps: int = 200) -> None:
    for _ in range(max_steps):
        if not engine.step():
            return
    raise AssertionError("the engine did not become idle")


def final(got: list[TokenEvent]) -> TokenEvent:
    assert got and got[-1].finished and not any(e.finished for e in got[:-1])
    return got[-1]


def idle_and_whole(engine: AsyncEngine) -> bool:
    pool, tree = engine.pool, engine.cache.tree
    check_invariants(engine.scheduler, len(engine._streams), len(engine._inbox))
    return pool.num_free + tree.num_cached_pages == pool.num_pages and not engine._streams


def output_of(got: list[TokenEvent]) -> list[int]:
    return [t for e in got for t in e.token_ids]


# -- level 1: one request ----------------------------------------------------------------


def test_a_detokenizer_failure_ends_only_its_request(engine):
    good = submit(engine, [1, 2, 3], **PLAIN)
    bad = submit(engine, [4, 5, 6], **PLAIN)
    bad.live.detokenizer = BrokenDetokenizer()
    run(engine)
    assert final(events(good)).finish_reason is FinishReason.LENGTH
    last = final(events(bad))
    assert last.finish_reason is FinishReason.ERROR and "detokenizer broke" in last.error
    assert engine.restarts == dict.fromkeys(engine.restarts, 0)
    assert idle_and_whole(engine)


class BrokenDetokenizer:
    stop_reason = None

    def push(self, token: int) -> str:
        raise RuntimeError("detokenizer broke")


def test_a_row_the_worker_cannot_run_fails_alone(engine):
    def hook(batch):
        if any(s.request_id == "bad" for s in batch.seqs):
            raise RuntimeError("bad row")

    engine.worker.fault_hook = hook
    good = submit(engine, [1, 2, 3], request_id="good", **PLAIN)
    bad = submit(engine, [4, 5, 6], request_id="bad", **PLAIN)
    run(engine)
    assert final(events(good)).finish_reason is FinishReason.LENGTH
    assert "bad row" in final(events(bad)).error
    assert engine.restarts == dict.fromkeys(engine.restarts, 0)
    assert idle_and_whole(engine)


@contextlib.contextmanager
def nan_weights(model: torch.nn.Module):
    """The first attention projection full of NaN for the duration: every K/V it writes, and
    every hidden state after it, is NaN. Its weight is the panel matmul's copy where fp32
    weights run on it (worker/cpu_linear.py's PanelLinear), else the parameter."""
    projection = model.layers[0].self_attn.qkv_proj
    panels = getattr(projection, "panels", None)
    weight = projection.weight if panels is None else panels.panels
    saved = weight.detach().clone()
    with torch.no_grad():
        weight.fill_(float("nan"))
    try:
        yield
    finally:
        with torch.no_grad():
            weight.copy_(saved)


def test_a_non_finite_prefill_chunk_is_never_cached(engine):
    """The first chunk of `bad` computes NaN K/V. It is not sampled, so no logits are checked;
    its pages must still stay out of the prefix cache, where a later request with the same
    prefix would read them."""
    prompt = list(range(1, 41))  # 40 tokens: chunks of 16, 16, 8
    runner = engine.worker.runner
    execute = runner.execute

    def poisoned(batch):
        if any(s.request_id == "bad" and s.start_pos == 0 for s in batch.seqs):
            with nan_weights(runner.model):
                return execute(batch)
        return execute(batch)

    runner.execute = poisoned
    bad = submit(engine, prompt, request_id="bad", **PLAIN)
    run(engine)
    runner.execute = execute
    assert "non-finite" in final(events(bad)).error
    assert engine.cache.tree.num_cached_pages == 0
    good = submit(engine, prompt, request_id="good", **PLAIN)
    run(engine)
    got = events(good)
    assert final(got).finish_reason is FinishReason.LENGTH and final(got).num_cached_tokens == 0
    again = submit(engine, prompt, **PLAIN)  # now served from good's (finite) pages
    run(engine)
    second = events(again)
    assert final(second).num_cached_tokens > 0 and output_of(second) == output_of(got)
    assert idle_and_whole(engine)


# -- level 2: rebuild ----------------------------------------------------------------------


def test_an_exception_inside_the_cache_rebuilds_and_serves_again(engine):
    victim = submit(engine, list(range(1, 30)), **PLAIN)
    engine.step()  # its first chunk is cached, so it locks a node of the tree
    victim.request.prefix_node = TreeNode(tokens=(), pages=[], parent=None)  # detached: corrupt
    bystander = submit(engine, [7, 8, 9], **PLAIN)  # in flight when the fault hits
    run(engine)
    for stream in (victim, bystander):
        last = final(events(stream))
        assert last.finish_reason is FinishReason.ERROR and "restarted" in last.error
    assert engine.restarts["cache_error"] == 1
    after = submit(engine, [1, 2, 3], **PLAIN)
    run(engine)
    assert final(events(after)).finish_reason is FinishReason.LENGTH
    assert idle_and_whole(engine)
    assert engine.stats()["engine_restarts_cache_error"] == 1


def test_a_failed_invariant_rebuilds(engine):
    stream = submit(engine, list(range(1, 30)), **PLAIN)
    engine.step()
    page = stream.request.page_ids[-1]
    engine.pool.free([page])  # the pool now hands out a page a running request owns
    with pytest.raises(InvariantError):
        check_invariants(engine.scheduler, len(engine._streams), len(engine._inbox))
    run(engine)
    assert "restarted" in final(events(stream)).error
    assert engine.restarts["invariant"] == 1
    assert idle_and_whole(engine)


def test_steps_failing_in_a_row_rebuild(engine):
    def hook(batch):
        raise RuntimeError("the device is unhappy")

    engine.worker.fault_hook = hook
    limit = engine.config.engine.max_failed_steps
    for i in range(limit):
        stream = submit(engine, [1 + i, 2, 3], **PLAIN)
        run(engine)
        assert "the device is unhappy" in final(events(stream)).error
    assert engine.restarts["failed_steps"] == 1
    engine.worker.fault_hook = None
    stream = submit(engine, [1, 2, 3], **PLAIN)
    run(engine)
    assert final(events(stream)).finish_reason is FinishReason.LENGTH
    assert idle_and_whole(engine)


# -- level 3: stop ---------------------------------------------------------------------------


def test_a_failed_rebuild_stops_the_engine(engine):
    told = []
    engine.on_dead = told.append
    stream = submit(engine, list(range(1, 30)), **PLAIN)
    engine.step()
    stream.request.prefix_node = TreeNode(tokens=(), pages=[], parent=None)

    def cannot_rebuild():
        raise MemoryError("no memory for a new page pool")

    engine._new_bookkeeping = cannot_rebuild
    with pytest.raises(EngineDeadError):
        run(engine)
    assert engine.dead is not None and len(told) == 1
    assert final(events(stream)).finish_reason is FinishReason.ERROR
    with pytest.raises(RuntimeError, match="stopped"):
        submit(engine, [1, 2], **PLAIN)
    assert not engine.progressing()


def test_a_cuda_error_stops_the_engine(engine):
    def hook(batch):
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")

    engine.worker.fault_hook = hook
    streams = [submit(engine, [i, 2, 3], **PLAIN) for i in range(1, 4)]
    with pytest.raises(EngineDeadError, match="illegal memory access"):
        run(engine)
    for stream in streams:
        assert final(events(stream)).finish_reason is FinishReason.ERROR
    assert engine.restarts == dict.fromkeys(engine.restarts, 0)


def test_rebuilds_with_no_good_step_between_stop_the_engine(engine):
    def hook(batch):
        raise RuntimeError("always")

    engine.worker.fault_hook = hook
    limit = engine.config.engine.max_failed_steps
    with pytest.raises(EngineDeadError, match="rebuilds"):
        for i in range(limit * (limit + 2)):
            submit(engine, [1 + i, 2], **PLAIN)
            run(engine)
    assert engine.restarts["failed_steps"] == limit


async def test_a_hung_step_stops_the_engine_after_the_timeout(tiny_model_dirs):
    import time

    config = load_config(
        env={},
        overrides={
            "model": str(tiny_model_dirs["llama"]),
            "kv_cache_gib": 0.01,
            "threads": 1,
            "step_timeout_s": 0.3,
        },
    )
    engine = AsyncEngine(config, show_progress=False)
    try:
        engine.worker.fault_hook = lambda batch: time.sleep(2)
        got = [e async for e in engine.generate([1, 2, 3], **PLAIN)]
        assert "engine.step_timeout_s" in final(got).error
        assert isinstance(engine.dead, EngineDeadError) and not engine.progressing()
    finally:
        await engine.shutdown()
