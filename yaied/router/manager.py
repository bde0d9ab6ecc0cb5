"""EngineManager: one router in front of several engines (Autellix's resource manager).

    start_call --route (policy.py)--> engine handle --events--> _deliver --> the caller's sink
        |                                                          |
    lifecycle PENDING          RUNNING on the first event, then COMPLETED | CANCELLED | FAILED

The manager owns the router-side view: outstanding calls and tokens per engine (the load the
policy reads), the session pins and hit rates (kv_coordinator.py), and each call's lifecycle. All
of it is mutated on the event loop only, so it needs no locks.

A call whose engine goes moves to another one (migration.py). The single-engine daemon is this
same code with one in-process engine.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from yaied.core.request import FinishReason, SamplingParams, TokenEvent
from yaied.core.stream import EventSink, EventStream
from yaied.router.calls import Call, RequestHandle
from yaied.router.config import RouterConfig
from yaied.router.front import front_inputs
from yaied.router.handle import (
    CallSink,
    EngineHandle,
    EngineUnavailable,
    InProcessHandle,
    StepObserver,
)
from yaied.router.kv_coordinator import KVCoordinator
from yaied.router.lifecycle import CallState, LifecycleTracker
from yaied.router.limits import ContextLimits, call_length, holds
from yaied.router.migration import CallMigration
from yaied.router.policy import EngineLoad, route
from yaied.router.pool import EnginePool
from yaied.router.status import ManagerStatus

if TYPE_CHECKING:
    from yaied.core.config import EngineConfig
    from yaied.engine.async_engine import AsyncEngine

log = logging.getLogger(__name__)

_STATE_OF = {
    FinishReason.STOP: CallState.COMPLETED,
    FinishReason.LENGTH: CallState.COMPLETED,
    FinishReason.ABORT: CallState.CANCELLED,
    FinishReason.ERROR: CallState.FAILED,
}


class NoEngineAvailable(RuntimeError):
    """No healthy engine can take the call (all are down, restarting or unsuited)."""


class EngineManager(ManagerStatus, EnginePool, CallMigration, ContextLimits):
    def __init__(
        self, config: RouterConfig | None = None, *, engine_config: EngineConfig | None = None
    ) -> None:
        self.config = config or RouterConfig()
        self.engine_config = engine_config  # what local engines run, and the front's model
        self.handles: dict[str, EngineHandle] = {}
        # This daemon among others: what its server answers as X-Yaied-Instance, what its
        # remote engines add to X-Yaied-Via, and how one of them tells that it is this daemon.
        self.instance_id = uuid.uuid4().hex
        self.lifecycle = LifecycleTracker(ttl_seconds=self.config.lifecycle_ttl_seconds)
        self.coordinator = KVCoordinator()
        # self.inputs, the front end (tokenize and validate), and self.info: limits.py
        self._calls: dict[str, Call] = {}
        self._outstanding: dict[str, dict[str, int]] = {}  # engine -> request id -> tokens
        self._turn = 0  # calls routed so far (round_robin's counter)
        self._background: set[asyncio.Task] = set()
        self._step_observer: StepObserver | None = None
        self._init_pool()
        self._init_migration()

    @classmethod
    def single(cls, engine: AsyncEngine, config: RouterConfig | None = None) -> EngineManager:
        """The classic daemon: one engine on the router's own event loop, engine id "0"."""
        manager = cls(config, engine_config=engine.config)
        manager.add_engine(InProcessHandle("0", engine), name="inprocess", origin="builtin")
        manager.inputs = engine.inputs
        return manager

    # -- engines (adding, draining and removing them: pool.py) -----------------------------

    @property
    def step_observer(self) -> StepObserver | None:
        return self._step_observer

    @step_observer.setter
    def step_observer(self, observer: StepObserver | None) -> None:
        self._step_observer = observer
        for handle in self.handles.values():
            handle.step_observer = observer

    async def start(self) -> None:
        """Start every engine at once; the front end learns the model's limits from them."""
        if not self.handles:
            raise ValueError("the manager has no engines: add_engine first")
        local = [h for h in self.handles.values() if h.kind == "local"]
        for handle in local:  # they share the cores unless given threads of their own
            handle.num_local_engines = len(local)  # type: ignore[attr-defined]
        await asyncio.gather(*(handle.start() for handle in self.handles.values()))
        infos = [h.info for h in self.handles.values() if h.info is not None]
        if self.inputs is None:
            assert self.engine_config is not None
            self.inputs = await asyncio.to_thread(front_inputs, self.engine_config.model, infos)
        self.running = True
        self._start_autoscaler()  # when [autoscale] enabled is set

    async def stop(self, timeout: float = 20.0) -> None:
        """Abort every call, then stop every engine, within ``timeout`` seconds (the daemon's
        stop budget): up to a quarter for the aborts' final events, the rest for the engines."""
        self._cancel_pool_tasks()
        loop = asyncio.get_running_loop()
        deadline, aborts_until = loop.time() + timeout, loop.time() + min(5.0, timeout / 4)
        self.abort_all()
        while self._calls and loop.time() < aborts_until:
            await asyncio.sleep(0.01)  # each abort ends its call with a final event
        left = max(0.0, deadline - loop.time())
        await asyncio.gather(*(h.stop(left) for h in self.handles.values()), return_exceptions=True)
        self.end_unanswered()
        for task in self._background:
            task.cancel()

    def _engine_lost(self, engine_id: str) -> None:
        cleared = self.coordinator.engine_lost(engine_id)
        log.warning("engine %s lost its cache: %d session pins cleared", engine_id, cleared)

    # -- calls ------------------------------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        return None if self.inputs is None else self.inputs.tokenizer

    async def submit_request(
        self,
        *,
        session_id: str | None = None,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        priority: int = 0,
        request_id: str | None = None,
        client_id: str | None = None,
    ) -> RequestHandle:
        """Validate, route and start one call, for a caller that wants a handle to read (the
        Python API, benchmarks). Bad input raises ValueError; no healthy engine raises
        NoEngineAvailable. The call runs whether or not its stream is read."""
        if self.inputs is None:
            raise NoEngineAvailable("the engines have not started")
        params = self.inputs.sampling_params(sampling_params, {})
        prompt_ids = self.inputs.prompt_token_ids(prompt, params)
        if params.structured is not None:  # compiled before admission: a bad spec raises here
            await self.inputs.grammars.compile(params.structured)
        request_id = request_id or uuid.uuid4().hex
        events: EventStream[None] = EventStream(on_close=lambda: self.cancel_nowait(request_id))
        call = self.start_call(
            prompt_ids,
            params,
            sink=events.sink(None),
            session_id=session_id,
            priority=priority,
            request_id=request_id,
            client_id=client_id,
        )
        return RequestHandle(call, events, self.cancel_nowait)

    def start_call(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        sink: EventSink,
        session_id: str | None = None,
        priority: int = 0,
        request_id: str | None = None,
        client_id: str | None = None,
        output_ids: Sequence[int] = (),
        via: tuple[str, ...] = (),
    ) -> Call:
        """Route and start one call whose prompt and parameters have been through
        ``self.inputs`` (the one input path: they are not checked again). Its events go to
        ``sink`` on the event loop, the last with a finish reason. No healthy engine raises
        NoEngineAvailable, before anything started. ``request_id`` is the call's key (unique
        among live calls; a new uuid when not given). ``client_id`` is the caller's name for it
        (an HTTP request's X-Request-Id, shared by its choices and by any other request that sent
        the same id), which ``cancel_client_request`` matches exactly; it defaults to the key.
        ``output_ids``: tokens its caller has already (a router that moved the call here sent
        them): it resumes after them, on an engine that resumes. ``via``: the daemons the call
        came through (X-Yaied-Via), passed on by remote engines."""
        if self.inputs is None:
            raise NoEngineAvailable("the engines have not started")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._calls:
            raise ValueError(f"request id {request_id!r} is already in use")
        client_id = request_id if client_id is None else client_id
        call = Call(request_id, session_id, prompt_ids, params, priority, sink, client_id)
        call.output_ids, call.streamed = list(output_ids), bool(output_ids)
        call.via = via
        engine = self._route(call, exclude=set())
        if engine is None:
            raise NoEngineAvailable(self._why_none_takes(call))
        self.lifecycle.add(request_id, session_id, len(prompt_ids), client_id)
        self._calls[request_id] = call
        self._dispatch(call, engine)
        return call

    def _why_none_takes(self, call: Call) -> str:
        length = call_length(len(call.prompt_ids), call.params)
        routable = [h for i, h in self.handles.items() if self.routable(i)]
        up = [h for h in routable if h.supports(call.params)]
        if routable and not up:  # remote engines only: they refuse these (RemoteHandle.supports)
            asks = "an embedding" if call.params.pooling else "logprobs"
            return f"no engine up takes a call that asks for {asks}: remote engines do not"
        if up and not any(holds(h, length) for h in up):
            largest = max(h.info.max_model_len for h in up if h.info is not None)
            return f"no engine up holds a call of {length} tokens (the largest up holds {largest})"
        return "no healthy engine can take the request"

    def _dispatch(self, call: Call, engine: EngineHandle | None) -> None:
        """Hand the call to ``engine``; one that cannot take it passes it on (see _give_up_on)."""
        while engine is not None:
            sink = CallSink(
                functools.partial(self._deliver_from, engine.engine_id, call.num_moves, call),
                functools.partial(self._lost, call, engine.engine_id, call.num_moves),
            )
            # A moved call resumes after what its caller has (only on engines that resume:
            # _route picked one); a copy, since a handle may send it from another thread.
            resume: dict[str, Any] = {}
            if call.output_ids:
                resume["output_ids"] = list(call.output_ids)
            if engine.forwards:
                resume["via"] = call.via
            try:
                engine.submit(
                    call.request_id,
                    call.prompt_ids,
                    call.params,
                    session_id=call.session_id,
                    priority=call.priority,
                    sink=sink,
                    **resume,
                )
                return
            except EngineUnavailable as exc:
                engine = self._give_up_on(call, engine.engine_id, str(exc))

    def _deliver_from(self, engine_id: str, move: int, call: Call, event: TokenEvent) -> None:
        """An engine's event for a call that is still that engine's (``move`` tells a return
        to an engine it left from the first visit): a call moved off a removed engine may hear
        from it until it stops, and that is dropped here."""
        if call.engine_id == engine_id and call.num_moves == move:
            self._deliver(call, event)

    def _route(self, call: Call, exclude: set[str]) -> EngineHandle | None:
        length = call_length(len(call.prompt_ids), call.params)
        loads = [
            EngineLoad(
                engine_id,
                len(self._outstanding[engine_id]),
                sum(self._outstanding[engine_id].values()),
                self.routable(engine_id)
                and engine_id not in exclude
                and handle.supports(call.params)
                and holds(handle, length)
                and (handle.resumes or not call.output_ids),
            )
            for engine_id, handle in self.handles.items()
        ]
        decision = route(
            self.config.policy,
            loads,
            num_prompt_tokens=len(call.prompt_ids),
            pinned=self.coordinator.pin_of(call.session_id),
            thresholds=self.config.thresholds,
            turn=self._turn,
        )
        self._turn += 1
        if decision is None:
            return None
        if decision.pin is not None:
            self.coordinator.set_pin(call.session_id, decision.pin)
        call.engine_id = decision.engine_id
        self._outstanding[decision.engine_id][call.request_id] = call.num_tokens
        return self.handles[decision.engine_id]

    def _deliver(self, call: Call, event: TokenEvent) -> None:
        """Record an event in the lifecycle and the coordinator, then hand it to the caller."""
        if call.finished:
            return
        record = self.lifecycle.get(call.request_id)
        state = CallState.RUNNING if event.finish_reason is None else _STATE_OF[event.finish_reason]
        if record.state is CallState.PENDING and state in (CallState.RUNNING, CallState.COMPLETED):
            self.lifecycle.transition(call.request_id, CallState.RUNNING, engine_id=call.engine_id)
        if event.token_ids:
            call.streamed = True
            call.output_ids.extend(event.token_ids)
        call.num_output_tokens = event.num_output_tokens or call.num_output_tokens
        if event.finished:
            call.finished = True
            self.lifecycle.transition(
                call.request_id,
                state,
                engine_id=call.engine_id,
                num_output_tokens=call.num_output_tokens,
                error=event.error,
            )
            if state is CallState.COMPLETED:
                self.coordinator.record(
                    call.session_id,
                    call.engine_id,
                    event.num_prompt_tokens or len(call.prompt_ids),
                    event.num_cached_tokens,
                    call.num_output_tokens,
                )
            del self._calls[call.request_id]
            self._outstanding[call.engine_id].pop(call.request_id, None)
        call.sink(event)

    async def cancel_request(self, request_id: str) -> bool:
        """Cancel one call: its stream ends with ``abort`` once the engine has let it go (within
        one step) and freed its pages. False when no such call is running."""
        call = self._calls.get(request_id)
        if call is None:
            return False
        call.cancelled = True
        if call.engine_id:
            await self.handles[call.engine_id].abort(request_id)
        return True

    def calls_of(self, client_id: str) -> list[str]:
        """The running calls whose client id is exactly ``client_id``: every choice of an HTTP
        request, and every request that sent that X-Request-Id. Never a prefix match."""
        return [call.request_id for call in self._calls.values() if call.client_id == client_id]

    async def cancel_client_request(self, client_id: str) -> int:
        """Cancel every running call of ``calls_of(client_id)``; returns how many."""
        results = await asyncio.gather(*(self.cancel_request(i) for i in self.calls_of(client_id)))
        return sum(results)

    def cancel_nowait(self, request_id: str) -> None:
        """cancel_request from code that cannot await (a stream's finally)."""
        if request_id in self._calls:
            task = asyncio.get_running_loop().create_task(self.cancel_request(request_id))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def cancel_session(self, session_id: str) -> int:
        """Cancel every running call of a session; returns how many."""
        ids = [c.request_id for c in self._calls.values() if c.session_id == session_id]
        results = await asyncio.gather(*(self.cancel_request(i) for i in ids))
        return sum(results)

    def abort_all(self) -> None:
        for request_id in list(self._calls):
            self.cancel_nowait(request_id)

    def end_unanswered(self) -> int:
        """End every call still running with a final ``abort`` event here, without its engine
        (one that never confirmed an abort: hung, or stopped); returns how many. What the
        engine sends for them later is dropped."""
        calls = list(self._calls.values())
        for call in calls:
            self._deliver(call, call.final_event(FinishReason.ABORT))
        return len(calls)

    @property
    def num_requests_in_flight(self) -> int:
        return len(self._calls)

    @property
    def num_calls_waiting(self) -> int:
        """Calls started here that have no token yet (queued or in prefill, on any engine):
        known at once, where engines' own counters arrive late or, for remote ones, by scrape."""
        return sum(not call.streamed for call in self._calls.values())

    def progressing(self) -> bool:
        """Whether every engine in this process advances its steps (see the watchdog)."""
        return all(handle.progressing() for handle in self.handles.values())

    @property
    def dead(self) -> str | None:
        """Why no engine can serve now, or None while at least one is up (and not draining)."""
        if any(self.routable(engine_id) for engine_id in self.handles):
            return None
        states = ", ".join(f"{i}: {self.engine_state(i)}" for i in self.handles)
        return f"no engine is up ({states})"
