"""The Ray actor's side of router/ray_handle.py: one AsyncEngine inside a Ray actor.

    router process (RayHandle)                       engine actor (async, one event loop)
    actor.load()                   ---------------->  AsyncEngine built in a thread -> ModelInfo
    actor.generate(id, prompt, ...) (a streaming     engine.add_request(sink=queue.put_nowait)
      generator) <--- lists of TokenEvents ---------  yields what the queue holds, each time
    actor.abort(id)                ---------------->  engine.abort(id)
    actor.stats()  (polled)        <----------------  engine.stats(), the steps' token counts

The same engine code as a local engine process (router/child.py): the actor only replaces the
pipes with Ray calls. Each ``generate`` yields every event its queue holds at once, so a busy
engine sends one Ray message per call per step, not one per token. An engine that died (a hung
step, a CUDA error) has failed its calls with error events; the actor then exits with status
3, and Ray restarts it (``max_restarts``) on a node that can hold it, where ``load`` builds a
fresh engine. This module imports neither torch nor Ray at the top: the actor sets the thread
count first.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from yaied.core.config import EngineConfig
from yaied.core.model_info import ModelInfo
from yaied.core.request import FinishReason, SamplingParams, TokenEvent

if TYPE_CHECKING:
    from yaied.engine.async_engine import AsyncEngine

log = logging.getLogger(__name__)
EXIT_ENGINE_DEAD = 3  # as router/child.py: the engine stopped for good; Ray restarts the actor
_EXIT_DELAY_SECONDS = 1.0  # the dead engine's error events leave before the actor exits
_MAX_EARLY_ABORTS = 4096  # aborts that overtook their generate call (an async actor's order)


class EngineActor:
    """Wrapped by ``ray.remote`` in router/ray_handle.py; every method runs on the actor's one
    event loop, as the engine's task does, so nothing here needs a lock."""

    def __init__(self, engine_id: str, config: EngineConfig, threads: int) -> None:
        os.environ["OMP_NUM_THREADS"] = str(threads)
        self.engine_id = engine_id
        self.config = config
        self.engine: AsyncEngine | None = None
        self._loading: asyncio.Future[ModelInfo] | None = None
        self._live: set[str] = set()  # calls in the engine whose stream is still open
        self._early_aborts: OrderedDict[str, None] = OrderedDict()
        self._steps: list[int] = []

    async def load(self) -> ModelInfo:
        """Build the engine (once per actor life; a restarted actor builds a new one)."""
        if self._loading is None:
            self._loading = asyncio.get_running_loop().create_task(self._build())
        return await asyncio.shield(self._loading)

    async def _build(self) -> ModelInfo:
        from yaied.engine.async_engine import AsyncEngine  # torch starts here

        engine = await asyncio.to_thread(AsyncEngine, self.config, show_progress=False)
        engine.keep_this_thread_serial()  # the actor's loop: no OpenMP team of its own
        engine.step_observer = self._steps.append
        engine.on_dead = self._die
        self.engine = engine
        return engine.info

    def _die(self, exc: BaseException) -> None:
        log.error("engine %s died: %s; the actor exits for Ray to restart it", self.engine_id, exc)
        threading.Timer(_EXIT_DELAY_SECONDS, os._exit, args=(EXIT_ENGINE_DEAD,)).start()

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        session_id: str | None,
        priority: int,
    ) -> AsyncIterator[list[TokenEvent]]:
        """One call's events, a list at a time, the last list ending with the final event. A
        consumer that goes away (the router cancelled the stream) aborts the call."""
        if request_id in self._early_aborts:
            del self._early_aborts[request_id]
            yield [_final(request_id, FinishReason.ABORT, None)]
            return
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        try:
            assert self.engine is not None, "the engine is not loaded"
            self.engine.add_request(
                prompt_ids,
                params,
                sink=queue.put_nowait,
                request_id=request_id,
                session_id=session_id,
                priority=priority,
            )
        except Exception as exc:  # a duplicate id, a dead engine: this call fails, not the actor
            yield [_final(request_id, FinishReason.ERROR, str(exc))]
            return
        finished = False
        self._live.add(request_id)
        try:
            while not finished:
                events = [await queue.get()]
                while not queue.empty():
                    events.append(queue.get_nowait())
                finished = events[-1].finished
                yield events
        finally:
            self._live.discard(request_id)
            if not finished and self.engine is not None:
                self.engine.abort(request_id)

    def abort(self, request_id: str) -> None:
        if self.engine is not None and request_id in self._live:
            self.engine.abort(request_id)
            return
        self._early_aborts[request_id] = None  # it overtook its generate call
        while len(self._early_aborts) > _MAX_EARLY_ABORTS:
            self._early_aborts.popitem(last=False)

    def stats(self) -> tuple[dict[str, int | float] | None, list[int]]:
        """The engine's counters, and the token counts of the steps since the last call."""
        steps, self._steps = self._steps, []
        if self.engine is None:
            return None, steps
        self.engine.step_observer = self._steps.append
        return self.engine.stats(), steps

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    async def shutdown(self) -> None:
        """Abort every call (each stream gets its final event) and stop the engine."""
        if self.engine is not None:
            self.engine.abort_all()
            await self.engine.shutdown()


def _final(request_id: str, reason: FinishReason, error: str | None) -> TokenEvent:
    return TokenEvent(request_id, [], "", reason, error=error)
