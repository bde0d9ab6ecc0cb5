"""The engine-handle interface, and the handle of an engine running in the router's own process.

A handle is all the manager knows of an engine, wherever it runs:

    submit(call id, prompt ids, params, ..., sink)   events -> sink.deliver, on the event loop
    abort(call id)    stats() -> the engine's counters    health    start() / stop()

Three kinds implement it: ``InProcessHandle`` (here: an AsyncEngine on the router's event loop,
the single-engine daemon), ``LocalProcessHandle`` (router/local_process.py: an engine process per
device) and ``RemoteHandle`` (router/remote.py: another yaied daemon over HTTP).

An engine that cannot take a call raises ``EngineUnavailable`` from submit; one lost with calls
in flight (process died, daemon unreachable) tells each of them ``sink.lost(reason)`` instead of
a final event. The manager then moves the call to another engine (manager.py), or fails it. A
failure of the request itself arrives as a final event with ``FinishReason.ERROR``, as from one
engine. A handle whose ``resumes`` is True takes a moved call's sent tokens (``output_ids``) and
resumes it there; the manager passes ``output_ids`` to no other kind.
"""

from __future__ import annotations

import abc
import enum
import functools
import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from yaied.core.model_info import ModelInfo
from yaied.core.processes import release_unloaded_objects
from yaied.core.request import FinishReason, SamplingParams, TokenEvent
from yaied.core.stream import EventSink, LostSink, StepObserver

if TYPE_CHECKING:
    from yaied.engine.async_engine import AsyncEngine

Stats = dict[str, int | float]


@dataclass(frozen=True, slots=True)
class CallSink:
    """Where a handle sends one call's events, on the event loop: every event to ``deliver``, the
    last with a finish reason; or, if the engine is lost first, one ``lost(reason)`` instead."""

    deliver: EventSink
    lost: LostSink


class Health(enum.StrEnum):
    STARTING = "starting"  # spawning or loading; not routed to yet
    UP = "up"
    DOWN = "down"  # died or unreachable; restarted or probed until it is back
    STOPPED = "stopped"


class EngineUnavailable(Exception):
    """The engine itself cannot serve (its process died, its daemon does not answer)."""


@dataclass(slots=True)
class EngineStatus:
    engine_id: str
    kind: str
    health: str
    num_requests: int
    num_tokens: int
    hit_rate: float
    stats: Stats | None = None
    where: dict[str, Any] = field(default_factory=dict)
    name: str = ""
    state: str = ""  # the pool's view (router/pool.py): starting, up, draining, down, removed

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.engine_id,
            "name": self.name,
            "kind": self.kind,
            "state": self.state,
            "health": self.health,
            "load": {"requests": self.num_requests, "tokens": self.num_tokens},
            "hit_rate": round(self.hit_rate, 4),
            "stats": self.stats,
            **self.where,
        }


class EngineHandle(abc.ABC):
    kind: str = ""
    # Whether submit takes ``output_ids``: a call moved from another engine, resumed after the
    # tokens its client has (AsyncEngine.add_request). Other kinds get only calls with no output.
    resumes: bool = False
    # Whether submit takes ``via``: the daemons a call passed through, which a handle that
    # forwards calls to another daemon sends on (X-Yaied-Via). Other kinds never get it.
    forwards: bool = False

    def __init__(self, engine_id: str) -> None:
        self.engine_id = engine_id
        self.health = Health.STARTING
        self.info: ModelInfo | None = None  # known once started
        # Told when the engine lost its KV cache (died, restarted, marked down): pins must go.
        self.on_lost: Callable[[str], None] | None = None
        self.step_observer: StepObserver | None = None

    @abc.abstractmethod
    async def start(self) -> None:
        """Bring the engine up; raises when it cannot (a model that does not load, say)."""

    @abc.abstractmethod
    async def stop(self, timeout: float = 15.0) -> None:
        """Abort what runs (each stream gets its final event) and release the engine, within
        ``timeout`` seconds (an engine that does not stop in time is killed where it can be)."""

    def released(self) -> None:
        """Told once the pool has removed this stopped engine for good (its status taken)."""
        return None  # an engine in another process or machine holds nothing here

    @abc.abstractmethod
    def submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        session_id: str | None,
        priority: int,
        sink: CallSink,
        output_ids: Sequence[int] = (),
    ) -> None:
        """Start a call (prompt and params validated by the router's front end); its events go
        to ``sink``. Raises EngineUnavailable when the engine cannot take it now. ``output_ids``
        (only where ``resumes``): tokens already sent, the call resumes after them."""

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None:
        """Abort a call: its stream ends with a final ``abort`` event. Unknown ids are a no-op."""

    @abc.abstractmethod
    def stats(self) -> Stats | None:
        """The engine's own counters (AsyncEngine.stats keys), or None when unknown."""

    def supports(self, params: SamplingParams) -> bool:
        """Whether this engine can run a call with these parameters."""
        return True

    def describe(self) -> dict[str, Any]:
        """Where the engine is, for /v1/engines."""
        return {}

    def progressing(self) -> bool:
        """False while an engine in this process has work but its steps stopped advancing.
        Engines in other processes watch themselves (a hung step stops their process)."""
        return True

    def comes_back(self) -> bool:
        """Whether the engine serves, or will again with nobody acting: one loading, or down
        and being restarted (a local process, a Ray actor) or probed (a remote daemon)."""
        return self.health is not Health.STOPPED

    def _lost(self) -> None:
        if self.on_lost is not None:
            self.on_lost(self.engine_id)


class InProcessHandle(EngineHandle):
    """An AsyncEngine on the router's own event loop: the single-engine daemon."""

    kind = "inprocess"
    resumes = True

    def __init__(self, engine_id: str, engine: AsyncEngine) -> None:
        super().__init__(engine_id)
        self.engine = engine
        self.info = engine.info
        engine.step_observer = self._observe_step

    def _observe_step(self, num_tokens: int) -> None:
        if self.step_observer is not None:
            self.step_observer(self.engine_id, num_tokens)

    @property
    def health(self) -> Health:
        engine = getattr(self, "engine", None)  # None once released
        if engine is not None and engine.dead is not None and self._health is Health.UP:
            return Health.DOWN  # the engine loop crashed; there is nothing to restart in-process
        return self._health

    @health.setter
    def health(self, value: Health) -> None:
        self._health = value

    def comes_back(self) -> bool:
        # A crashed loop in this process is not restarted here (the daemon exits for that).
        engine = getattr(self, "engine", None)
        return engine is not None and engine.dead is None and super().comes_back()

    async def start(self) -> None:
        self.engine.keep_this_thread_serial()  # the daemon's loop: no OpenMP team of its own
        self.health = Health.UP

    async def stop(self, timeout: float = 15.0) -> None:
        # Within one step: the engine task stops between steps (a hung step made it dead, and
        # then it is not waited for).
        self.health = Health.STOPPED
        await self.engine.shutdown()
        # The daemon froze the loaded objects (core/processes.py): whatever of this engine is
        # held in reference cycles goes back to the collector, or its weights would stay.
        gc.unfreeze()

    def released(self) -> None:
        # The pool let go of this handle: the engine's last reference goes, and it is collected
        # now (after a freeze the next full collection may be far off) with the heap trimmed,
        # or its weights and KV pool would stay in the daemon's memory.
        del self.engine
        release_unloaded_objects()

    def submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        session_id: str | None,
        priority: int,
        sink: CallSink,
        output_ids: Sequence[int] = (),
    ) -> None:
        if self.engine.dead is not None:
            raise EngineUnavailable(f"engine {self.engine_id} has stopped: {self.engine.dead}")
        self.engine.add_request(
            prompt_ids,
            params,
            sink=functools.partial(self._deliver, sink),
            request_id=request_id,
            session_id=session_id,
            priority=priority,
            output_ids=output_ids,
        )

    def _deliver(self, sink: CallSink, event: TokenEvent) -> None:
        # The engine's death fails each call with a final error event: the call is lost (the
        # manager moves it to another engine), as from a dead engine process.
        if event.finish_reason is FinishReason.ERROR and self.engine.dead is not None:
            sink.lost(f"engine {self.engine_id}: {event.error}")
        else:
            sink.deliver(event)

    async def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def stats(self) -> Stats | None:
        return self.engine.stats()

    def describe(self) -> dict[str, Any]:
        return {"device": self.engine.info.device}

    def progressing(self) -> bool:
        return self.engine.progressing()
