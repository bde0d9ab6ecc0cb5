"""Calls that outlive their engine, over fake engines: a call moves to another engine and goes on
after the tokens its caller has (one stream: no token twice or missing, one final event), at
most twice; with nowhere to go it ends with one error event at once. Recorded in the lifecycle
and counted in yaied:call_migrations_total."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from tests.router.test_manager import FakeEngine, params
from tests.waiting import async_wait_until
from yaied.core.model_info import ModelInfo
from yaied.core.request import FinishReason, TokenEvent
from yaied.engine.inputs import InputProcessor
from yaied.router.calls import MAX_MOVES
from yaied.router.config import RouterConfig
from yaied.router.handle import Health
from yaied.router.lifecycle import CallState
from yaied.router.manager import EngineManager
from yaied.server.metrics import ServerMetrics

pytestmark = pytest.mark.timeout(30)


class ResumingEngine(FakeEngine):
    """Streams token i as the i-th output token, resuming after ``output_ids``; ``die_after``
    counts the tokens this engine streamed itself."""

    resumes = True

    def __init__(self, engine_id: str, tick: float = 0.005) -> None:
        super().__init__(engine_id, tick)
        self.resumed: dict[str, list[int]] = {}

    def submit(self, request_id, prompt_ids, params, *, session_id, priority, sink, output_ids=()):
        self.resumed[request_id] = list(output_ids)
        super().submit(
            request_id, prompt_ids, params, session_id=session_id, priority=priority, sink=sink
        )

    async def _run(self, request_id, prompt_ids, params, sink) -> None:
        start = len(self.resumed[request_id])
        try:
            for n, i in enumerate(range(start, params.max_tokens)):
                await asyncio.sleep(self.tick)
                if self.die_after is not None and n >= self.die_after:
                    self.health = Health.DOWN
                    self._lost()
                    sink.lost(f"engine {self.engine_id} died")
                    return
                if request_id in self.aborted:
                    sink.deliver(TokenEvent(request_id, [], "", FinishReason.ABORT))
                    return
                last = i == params.max_tokens - 1
                reason = FinishReason.LENGTH if last else None
                sink.deliver(
                    TokenEvent(
                        request_id,
                        [i],
                        f"<{i}>",
                        reason,
                        num_prompt_tokens=len(prompt_ids),
                        num_output_tokens=i + 1,
                    )
                )
        finally:
            self.running.discard(request_id)


async def with_engines(engines: list[FakeEngine]) -> EngineManager:
    manager = EngineManager(RouterConfig())
    for engine in engines:
        manager.add_engine(engine)
    hf_config = SimpleNamespace(eos_token_id=None)
    manager.inputs = InputProcessor(None, hf_config, ModelInfo(8192, 256))  # no model files
    await manager.start()
    return manager


async def events_of(handle) -> list[TokenEvent]:
    return [event async for event in handle.stream()]


def check_one_stream(events: list[TokenEvent], num_tokens: int) -> None:
    """Every token once, in order, text with them, and exactly one final event, the last."""
    tokens = [t for e in events for t in e.token_ids]
    assert tokens == list(range(num_tokens))
    assert "".join(e.text for e in events) == "".join(f"<{i}>" for i in range(num_tokens))
    assert [e.finished for e in events].count(True) == 1 and events[-1].finished


async def test_a_streaming_call_moves_when_its_engine_dies_and_the_caller_reads_one_stream():
    first, second = ResumingEngine("0"), ResumingEngine("1")
    first.die_after = 3
    manager = await with_engines([first, second])
    handle = await manager.submit_request(prompt=[1, 2, 3], sampling_params=params(10))
    assert handle.engine_id == "0"
    events = await events_of(handle)
    check_one_stream(events, 10)
    assert events[-1].finish_reason is FinishReason.LENGTH
    assert events[-1].num_prompt_tokens == 3 and events[-1].num_output_tokens == 10
    assert second.resumed[handle.request_id] == [0, 1, 2]  # the tokens the caller had
    record = manager.lifecycle.get(handle.request_id)
    assert record.state is CallState.COMPLETED and record.engine_id == "1"
    assert [(m.from_engine, m.to_engine, m.num_sent_tokens) for m in record.moves] == [
        ("0", "1", 3)
    ]
    assert manager.migrations == {"moved": 1, "failed": 0}
    metrics = ServerMetrics(
        "m",
        lambda: {},
        pool_stats=lambda: (manager.engine_counts(), {}, dict(manager.migrations)),
    )
    text = metrics.render().decode()
    assert 'yaied:call_migrations_total{model_name="m",outcome="moved"} 1.0' in text
    assert 'yaied:call_migrations_total{model_name="m",outcome="failed"} 0.0' in text
    await manager.stop()


async def test_a_call_moves_at_most_twice_then_ends_with_one_error_event():
    engines = [ResumingEngine(str(i)) for i in range(4)]
    for engine in engines:
        engine.die_after = 2
    manager = await with_engines(engines)
    handle = await manager.submit_request(prompt=[1], sampling_params=params(20))
    events = await events_of(handle)
    assert [t for e in events for t in e.token_ids] == list(range(2 * (MAX_MOVES + 1)))
    assert [e.finished for e in events].count(True) == 1
    assert events[-1].finish_reason is FinishReason.ERROR
    assert f"moved {MAX_MOVES} times" in events[-1].error
    record = manager.lifecycle.get(handle.request_id)
    assert record.state is CallState.FAILED and len(record.moves) == MAX_MOVES
    assert manager.migrations == {"moved": MAX_MOVES, "failed": 1}
    await manager.stop()


async def test_with_no_engine_to_move_to_a_call_ends_with_an_error_at_once():
    only = ResumingEngine("0")
    only.die_after = 2
    manager = await with_engines([only])
    handle = await manager.submit_request(prompt=[1], sampling_params=params(50))
    events = await asyncio.wait_for(events_of(handle), 5)
    assert [t for e in events for t in e.token_ids] == [0, 1]
    assert events[-1].finish_reason is FinishReason.ERROR and "died" in events[-1].error
    assert manager.migrations == {"moved": 0, "failed": 1}
    assert manager.num_requests_in_flight == 0
    await manager.stop()


async def test_a_call_cancelled_as_its_engine_dies_ends_with_abort_and_never_moves():
    """The cancel reached the router but not the engine, which died first: the client asked
    for the cancel (and was told it took), so its stream ends with abort, not an error."""
    first, second = ResumingEngine("0", tick=0.02), ResumingEngine("1")
    first.die_after = 5

    async def unanswered(request_id: str) -> None:  # the dead engine never reads the abort
        pass

    first.abort = unanswered
    manager = await with_engines([first, second])
    handle = await manager.submit_request(prompt=[1], sampling_params=params(50))
    await asyncio.sleep(0.03)
    assert await manager.cancel_request(handle.request_id)
    events = await asyncio.wait_for(events_of(handle), 5)
    assert [e.finished for e in events].count(True) == 1
    assert events[-1].finish_reason is FinishReason.ABORT and events[-1].error is None
    assert handle.request_id not in second.resumed  # a cancelled call never moves
    assert manager.migrations == {"moved": 0, "failed": 0}
    assert manager.num_requests_in_flight == 0
    await manager.stop()


async def test_a_call_with_output_never_moves_to_an_engine_that_cannot_resume():
    resuming, plain = ResumingEngine("0"), FakeEngine("1")
    resuming.die_after = 2
    manager = await with_engines([resuming, plain])
    handle = await manager.submit_request(prompt=[1], sampling_params=params(10))
    events = await events_of(handle)
    assert events[-1].finish_reason is FinishReason.ERROR
    assert plain.seen == []  # a remote daemon, say: it would start the output over
    await manager.stop()


async def test_removing_an_engine_with_8_streams_open_moves_every_one():
    first, second = ResumingEngine("0", tick=0.02), ResumingEngine("1")
    manager = await with_engines([first, second])
    second.health = Health.STARTING  # the 8 streams all start on engine 0
    handles = [
        await manager.submit_request(prompt=[1, 2], sampling_params=params(40)) for _ in range(8)
    ]
    assert {h.engine_id for h in handles} == {"0"}
    second.health = Health.UP
    reading = [asyncio.create_task(events_of(h)) for h in handles]
    await async_wait_until(
        lambda: manager.num_calls_waiting == 0, timeout=10, what="every stream's first token"
    )
    await manager.remove_engine("0", timeout=0.1)  # they do not finish in time: they move
    for events in await asyncio.gather(*reading):
        check_one_stream(events, 40)
        assert events[-1].finish_reason is FinishReason.LENGTH
    assert manager.engine_state("0") == "removed"
    assert all(len(r.moves) == 1 for r in (manager.lifecycle.get(h.request_id) for h in handles))
    assert manager.migrations == {"moved": 8, "failed": 0}
    await manager.stop()
