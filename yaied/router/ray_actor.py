"""The Ray actor's side of router/ray_handle.py: one AsyncEngine inside a Ray actor.

    router process (RayHandle)                     engine actor (async, one event loop)
    actor.load()                 ---------------->  AsyncEngine built in a thread -> ModelInfo
    actor.events() (a streaming  <-- (events, stats, steps) --  every call's events, as the
      generator, one per life)                      engine's sink puts them in the outbox
    actor.submit(id, prompt, ...) -------------->  engine.add_request(sink=outbox)
    actor.abort(id)              ---------------->  engine.abort(id)

The same engine code as a local engine process (router/child.py), with the three pipes replaced
by Ray calls, and the event pipe by one streaming generator: each item holds every event the
outbox held, for all calls, so a busy engine sends one Ray message per few steps, not one per
call or per token, and the stats ride along every STATS_INTERVAL (the router's watch: a stream
silent for long means the actor is gone). An item costs both sides a fraction of a millisecond
of CPU, as much as a short step: a call's first event and its final one leave at once, the
tokens between wait up to HOLD_SECONDS for company (the next item, at most a few steps later).
An engine that died (a hung step, a CUDA error) has failed its calls with error events; the
actor then exits with status 3, and Ray restarts it (``max_restarts``) on a node that can hold
it, where ``load`` builds a fresh engine. This module imports neither torch nor Ray at the top:
the actor sets the thread count first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from yaied.core.config import EngineConfig
from yaied.core.model_info import ModelInfo
from yaied.core.processes import freeze_loaded_objects, match_niceness
from yaied.core.request import FinishReason, SamplingParams, TokenEvent

if TYPE_CHECKING:
    from yaied.engine.async_engine import AsyncEngine

log = logging.getLogger(__name__)
Stats = dict[str, int | float]
STATS_INTERVAL = 0.2  # seconds between the stats the actor sends, as a local engine process
HOLD_SECONDS = 0.005  # the longest a call's middle tokens wait for the next item
EXIT_ENGINE_DEAD = 3  # as router/child.py: the engine stopped for good; Ray restarts the actor
_EXIT_DELAY_SECONDS = 1.0  # the dead engine's error events leave before the actor exits
_MAX_EARLY_ABORTS = 4096  # aborts that overtook their generate call (an async actor's order)


class EngineActor:
    """Wrapped by ``ray.remote`` in router/ray_handle.py; every method runs on the actor's one
    event loop, as the engine's task does, so nothing here needs a lock."""

    def __init__(
        self,
        engine_id: str,
        config: EngineConfig,
        threads: int,
        group: Any = None,  # a tensor-parallel engine's placement group: its ranks go there
        bundle: dict[str, float] | None = None,  # what each rank holds
        niceness: int = 0,  # the daemon's: the engine runs at its priority, not Ray's
    ) -> None:
        os.environ["OMP_NUM_THREADS"] = str(threads)
        problem = match_niceness(niceness)
        if problem:
            log.warning("engine %s: %s", engine_id, problem)
        self.engine_id = engine_id
        self.config = config
        self.group = group
        self.bundle = bundle or {}
        self.niceness = niceness
        self.engine: AsyncEngine | None = None
        self._loading: asyncio.Future[ModelInfo] | None = None
        self._live: set[str] = set()  # calls in the engine whose final event is not sent yet
        self._outbox: list[TokenEvent] = []  # events not sent yet, oldest first
        self._due = 0.0  # when the outbox must leave (time.monotonic); 0: at once
        self._wake = asyncio.Event()  # the outbox is due, or its first event came
        self._started: set[str] = set()  # calls whose first event left the actor
        self._stream_gen = 0  # which ``events`` call reads the outbox
        self._early_aborts: OrderedDict[str, None] = OrderedDict()
        self._steps: list[int] = []

    async def load(self) -> ModelInfo:
        """Build the engine (once per actor life; a restarted actor builds a new one)."""
        if self._loading is None:
            self._loading = asyncio.get_running_loop().create_task(self._build())
        return await asyncio.shield(self._loading)

    async def _build(self) -> ModelInfo:
        from yaied.engine.async_engine import AsyncEngine  # torch starts here

        launcher = None
        if self.group is not None:
            from yaied.engine.ranks import ray_rank_launcher

            launcher = ray_rank_launcher(self.group, self.bundle, self.niceness)
        engine = await asyncio.to_thread(
            AsyncEngine, self.config, show_progress=False, rank_launcher=launcher
        )
        engine.keep_this_thread_serial()  # the actor's loop: no OpenMP team of its own
        engine.step_observer = self._steps.append
        engine.on_dead = self._die
        self.engine = engine
        freeze_loaded_objects()
        return engine.info

    def _die(self, exc: BaseException) -> None:
        log.error("engine %s died: %s; the actor exits for Ray to restart it", self.engine_id, exc)
        threading.Timer(_EXIT_DELAY_SECONDS, os._exit, args=(EXIT_ENGINE_DEAD,)).start()

    async def events(self) -> AsyncIterator[tuple[list[TokenEvent], Stats | None, list[int]]]:
        """The engine's one outgoing stream (a Ray streaming generator, read by the router for
        as long as the actor lives): every call's events as the engine sends them, a list at a
        time, and every STATS_INTERVAL its counters and the token counts of its steps since."""
        next_stats = 0.0
        self._stream_gen += 1  # a new reader (the router came back after a silence) replaces
        ours = self._stream_gen  # the old one, which must not take events from the outbox
        while ours == self._stream_gen:
            await self._until_due(next_stats)
            if ours != self._stream_gen:
                return  # the outbox is the new reader's
            events, self._outbox = self._outbox, []
            stats, steps = None, []
            if time.monotonic() >= next_stats:
                next_stats = time.monotonic() + STATS_INTERVAL
                steps, self._steps = self._steps, []
                if self.engine is not None:
                    self.engine.step_observer = self._steps.append
                    stats = self.engine.stats()
            yield events, stats, steps

    async def _until_due(self, next_stats: float) -> None:
        """Wait until the outbox is due or the stats are (both in time.monotonic)."""
        while (now := time.monotonic()) < next_stats and (not self._outbox or now < self._due):
            self._wake.clear()
            until = min(next_stats, self._due) if self._outbox else next_stats
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), until - now)

    def submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        session_id: str | None,
        priority: int,
        output_ids: list[int] | None = None,
    ) -> None:
        """Start a call (a moved one resumes after ``output_ids``, the tokens its caller has);
        its events go out on ``events``. A failure to start it (a duplicate id, a dead engine)
        is its final error event, never the actor's."""
        if request_id in self._early_aborts:
            del self._early_aborts[request_id]
            self._send(_final(request_id, FinishReason.ABORT, None))
            return
        try:
            assert self.engine is not None, "the engine is not loaded"
            self.engine.add_request(
                prompt_ids,
                params,
                sink=self._send,
                request_id=request_id,
                session_id=session_id,
                priority=priority,
                output_ids=output_ids or (),
            )
        except Exception as exc:
            self._send(_final(request_id, FinishReason.ERROR, str(exc)))
            return
        self._live.add(request_id)

    def _send(self, event: TokenEvent) -> None:
        """Into the outbox: a call's first event or final one makes it due at once, any other
        within HOLD_SECONDS (the events of the steps meanwhile go with it)."""
        due = self._due if self._outbox else time.monotonic() + HOLD_SECONDS
        if event.finished:
            self._live.discard(event.request_id)
            self._started.discard(event.request_id)
            due = 0.0
        elif event.request_id not in self._started:
            self._started.add(event.request_id)
            due = 0.0
        if due < self._due or not self._outbox:
            self._wake.set()
        self._due = due
        self._outbox.append(event)

    def abort(self, request_id: str) -> None:
        if self.engine is not None and request_id in self._live:
            self.engine.abort(request_id)
            return
        self._early_aborts[request_id] = None  # it overtook its submit (an async actor's order)
        while len(self._early_aborts) > _MAX_EARLY_ABORTS:
            self._early_aborts.popitem(last=False)

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    async def shutdown(self) -> None:
        """Abort every call (each gets its final event, sent on ``events``) and stop the
        engine."""
        if self.engine is None:
            return
        self.engine.abort_all()
        for _ in range(500):  # each abort ends its call with a final event within a step
            if not self._live:
                break
            await asyncio.sleep(0.01)
        await self.engine.shutdown()


def _final(request_id: str, reason: FinishReason, error: str | None) -> TokenEvent:
    return TokenEvent(request_id, [], "", reason, error=error)
