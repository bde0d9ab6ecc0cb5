"""EngineManager over fake engines: routing, lifecycle, cancellation, retry and failure."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from yaied.core.model_info import ModelInfo
from yaied.core.request import FinishReason, SamplingParams, TokenEvent
from yaied.engine.inputs import InputProcessor
from yaied.router.config import RouterConfig
from yaied.router.handle import EngineHandle, EngineUnavailable, Health
from yaied.router.lifecycle import CallState
from yaied.router.manager import EngineManager, NoEngineAvailable

pytestmark = pytest.mark.timeout(30)


class FakeEngine(EngineHandle):
    """Streams one token per tick; can be told to die before or after its first token."""

    kind = "fake"

    def __init__(self, engine_id: str, tick: float = 0.01) -> None:
        super().__init__(engine_id)
        self.tick = tick
        self.info = ModelInfo(8192, 256)
        self.aborted: set[str] = set()
        self.running: set[str] = set()
        self.seen: list[str] = []
        self.die_after: int | None = None  # tokens to stream before the engine is lost
        self.tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        self.health = Health.UP

    async def stop(self, timeout: float = 15.0) -> None:
        self.health = Health.STOPPED

    def submit(self, request_id, prompt_ids, params, *, session_id, priority, sink):
        if self.health is not Health.UP:
            raise EngineUnavailable(f"engine {self.engine_id} is {self.health.value}")
        self.seen.append(request_id)
        self.running.add(request_id)
        task = asyncio.get_running_loop().create_task(
            self._run(request_id, prompt_ids, params, sink)
        )
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _run(self, request_id, prompt_ids, params, sink) -> None:
        try:
            for i in range(params.max_tokens):
                await asyncio.sleep(self.tick)
                if self.die_after is not None and i >= self.die_after:
                    self.health = Health.DOWN
                    self._lost()
                    sink.lost(f"engine {self.engine_id} died")
                    return
                if request_id in self.aborted:
                    sink.deliver(TokenEvent(request_id, [], "", FinishReason.ABORT))
                    return
                last = i == params.max_tokens - 1
                sink.deliver(
                    TokenEvent(
                        request_id,
                        [i],
                        "x",
                        FinishReason.LENGTH if last else None,
                        num_prompt_tokens=len(prompt_ids),
                        num_output_tokens=i + 1,
                        num_cached_tokens=len(prompt_ids) // 2 if last else 0,
                    )
                )
        finally:
            self.running.discard(request_id)

    async def abort(self, request_id: str) -> None:
        self.aborted.add(request_id)

    def stats(self):
        return {"num_requests_waiting": 0, "num_requests_running": len(self.running)}


async def started(n: int = 2, **router: object) -> tuple[EngineManager, list[FakeEngine]]:
    manager = EngineManager(RouterConfig(**router))
    engines = [FakeEngine(str(i)) for i in range(n)]
    for engine in engines:
        manager.add_engine(engine)
    hf_config = SimpleNamespace(eos_token_id=None)
    manager.inputs = InputProcessor(None, hf_config, ModelInfo(8192, 256))  # no model files
    await manager.start()
    return manager, engines


def params(max_tokens: int = 4) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0)


async def test_short_calls_spread_and_complete():
    manager, engines = await started()
    handles = [
        await manager.submit_request(prompt=[1, 2, 3], sampling_params=params()) for _ in range(4)
    ]
    assert sorted(h.engine_id for h in handles) == ["0", "0", "1", "1"]
    outputs = await asyncio.gather(*(h.result() for h in handles))
    assert all(o.finish_reason is FinishReason.LENGTH and len(o.token_ids) == 4 for o in outputs)
    records = [manager.lifecycle.get(h.request_id) for h in handles]
    assert all(r.state is CallState.COMPLETED and r.service_time > 0 for r in records)
    assert manager.get_stats()["hit_rate"] == pytest.approx(0.0 + 1 / 3)
    await manager.stop()


async def test_a_long_session_stays_on_its_engine():
    manager, engines = await started(long_call_threshold=8)
    long_prompt = list(range(20))
    first = await manager.submit_request(
        session_id="s", prompt=long_prompt, sampling_params=params()
    )
    busy = [await manager.submit_request(prompt=[1], sampling_params=params(50)) for _ in range(3)]
    second = await manager.submit_request(
        session_id="s", prompt=long_prompt, sampling_params=params()
    )
    assert first.engine_id == second.engine_id
    assert manager.coordinator.pin_of("s") == first.engine_id
    for handle in busy:
        await handle.cancel()
    await asyncio.gather(first.result(), second.result(), *(h.result() for h in busy))
    await manager.stop()


async def test_cancel_request_and_cancel_session():
    manager, engines = await started()
    a = await manager.submit_request(session_id="s", prompt=[1], sampling_params=params(1000))
    b = await manager.submit_request(session_id="s", prompt=[1], sampling_params=params(1000))
    other = await manager.submit_request(session_id="t", prompt=[1], sampling_params=params(5))
    assert await manager.cancel_request(a.request_id)
    assert (await a.result()).finish_reason is FinishReason.ABORT
    assert not await manager.cancel_request(a.request_id)  # already over
    assert await manager.cancel_session("s") == 1
    assert (await b.result()).finish_reason is FinishReason.ABORT
    assert (await other.result()).finish_reason is FinishReason.LENGTH
    states = {r.request_id: r.state for r in manager.lifecycle.by_session("s")}
    assert states == {a.request_id: CallState.CANCELLED, b.request_id: CallState.CANCELLED}
    await manager.stop()


async def test_closing_the_stream_cancels_the_call():
    manager, engines = await started()
    handle = await manager.submit_request(prompt=[1], sampling_params=params(1000))
    async for _ in handle:
        break
    for _ in range(100):
        if manager.lifecycle.get(handle.request_id).state is CallState.CANCELLED:
            break
        await asyncio.sleep(0.01)
    assert manager.lifecycle.get(handle.request_id).state is CallState.CANCELLED
    assert manager.num_requests_in_flight == 0
    await manager.stop()


async def test_a_lost_engine_retries_unstreamed_calls_and_fails_streamed_ones():
    manager, (e0, e1) = await started(long_call_threshold=1)
    e0.die_after = 0  # dies before its first token
    retried = await manager.submit_request(session_id="s", prompt=[1, 2], sampling_params=params())
    assert retried.engine_id == "0" and manager.coordinator.pin_of("s") == "0"
    out = await retried.result()
    assert out.finish_reason is FinishReason.LENGTH and retried.engine_id == "1"
    assert manager.lifecycle.get(retried.request_id).engine_id == "1"
    assert manager.coordinator.pin_of("s") == "1"  # the dead one's pin went; pinned anew
    e1.die_after = 2  # dies mid-stream
    e0.health = Health.DOWN
    failed = await manager.submit_request(prompt=[1], sampling_params=params())
    events = [event async for event in failed]
    assert [len(e.token_ids) for e in events] == [1, 1, 0]
    assert events[-1].finish_reason is FinishReason.ERROR and "died" in events[-1].error
    assert manager.lifecycle.get(failed.request_id).state is CallState.FAILED
    with pytest.raises(NoEngineAvailable):
        await manager.submit_request(prompt=[1], sampling_params=params())
    assert manager.dead is not None
    await manager.stop()


async def test_a_call_only_local_engines_take_says_why_when_none_is_up():
    # A pool of remote daemons serves no logprobs and no embeddings (RemoteHandle.supports):
    # the 503 says so, rather than that no engine is healthy while every one is up.
    class RemoteLike(FakeEngine):
        def supports(self, params):
            return params.logprobs is None and not params.pooling

    manager = EngineManager(RouterConfig())
    manager.add_engine(RemoteLike("0"))
    manager.inputs = InputProcessor(None, SimpleNamespace(eos_token_id=None), ModelInfo(8192, 256))
    await manager.start()
    plain = await manager.submit_request(prompt=[1, 2], sampling_params=params())
    assert (await plain.result()).finish_reason is FinishReason.LENGTH
    with pytest.raises(NoEngineAvailable, match="asks for logprobs: remote engines do not"):
        await manager.submit_request(
            prompt=[1, 2], sampling_params=SamplingParams(max_tokens=2, logprobs=1)
        )
    embedding = SamplingParams(max_tokens=1, pooling="mean")
    with pytest.raises(NoEngineAvailable, match="asks for an embedding: remote engines do not"):
        await manager.submit_request(prompt=[1, 2], sampling_params=embedding)
    await manager.stop()


async def test_client_ids_may_repeat_and_cancel_matches_them_exactly():
    manager, engines = await started()
    foo = [
        await manager.submit_request(prompt=[1], sampling_params=params(1000), client_id="foo")
        for _ in range(2)
    ]
    foo3 = await manager.submit_request(prompt=[1], sampling_params=params(1000), client_id="foo-3")
    assert len({h.request_id for h in foo}) == 2 and {h.client_id for h in foo} == {"foo"}
    assert sorted(manager.calls_of("foo")) == sorted(h.request_id for h in foo)
    assert manager.calls_of("fo") == [] and manager.calls_of("foo-") == []
    assert await manager.cancel_client_request("foo") == 2
    for handle in foo:
        assert (await handle.result()).finish_reason is FinishReason.ABORT
    live = (CallState.PENDING, CallState.RUNNING)
    assert manager.lifecycle.get(foo3.request_id).state in live  # foo-3 is not foo
    assert [r.state for r in manager.lifecycle.by_client_id("foo")] == [CallState.CANCELLED] * 2
    assert await manager.cancel_client_request("foo") == 0
    assert await manager.cancel_client_request("foo-3") == 1
    assert (await foo3.result()).finish_reason is FinishReason.ABORT
    seen = [rid for engine in engines for rid in engine.seen]
    assert sorted(seen) == sorted([*(h.request_id for h in foo), foo3.request_id])
    await manager.stop()


async def test_bad_input_and_duplicate_ids_are_value_errors():
    manager, _ = await started()
    with pytest.raises(ValueError, match="token ids must be"):
        await manager.submit_request(prompt=[999], sampling_params=params())
    handle = await manager.submit_request(prompt=[1], sampling_params=params(), request_id="x")
    with pytest.raises(ValueError, match="already in use"):
        await manager.submit_request(prompt=[1], sampling_params=params(), request_id="x")
    await handle.result()
    status = manager.get_engine_status("0").as_json()
    assert status["health"] == "up" and status["load"] == {"requests": 0, "tokens": 0}
    await manager.stop()
