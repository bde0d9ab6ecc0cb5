"""The elastic engine pool: engines added, drained and removed while the router serves.

A mixin of `EngineManager` (like status.py), so that manager.py stays about calls. An engine's
life in the pool, as ``GET /v1/engines`` shows it:

    add_engine --> starting --(healthy)--> up <--> down (died: restarted; remote: probed)
                                            |
                                 drain_engine: draining (no new calls; in-flight calls finish)
                                            |
         remove_engine: calls left at the timeout move to other engines, resumed after the
                        tokens sent (manager.py) --> the engine stopped --> removed

Ids are "0", "1", ... in the order added and never reused, so a log line or a lifecycle record
names one engine for the daemon's whole life. Names are what operators and the config use: an
``[[engines]]`` entry's ``name``, else one made from what it is (``local-cpu``, ``remote-
10.0.0.2:8000``, ``-2`` on for a second alike). A reload diffs the config by name (reload.py in
the server) and touches only engines that came from the config, not those added over the API or
by the autoscaler. Every change is logged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from yaied.core.metric_names import ENGINE_GAUGES
from yaied.router.autoscale import AutoscaleConfig, Autoscaler
from yaied.router.config import EngineEntry
from yaied.router.handle import EngineHandle, Health, Stats
from yaied.router.names import base_name, entry_names, first_free
from yaied.router.room import HostRoom, check_room

if TYPE_CHECKING:
    from yaied.core.config import EngineConfig
    from yaied.router.calls import Call
    from yaied.router.config import RouterConfig
    from yaied.router.kv_coordinator import KVCoordinator

log = logging.getLogger(__name__)

STATES = ("starting", "up", "draining", "down", "removed")
ORIGINS = ("config", "api", "autoscale", "builtin")  # who added the engine
ENGINE_STOP_SECONDS = 10.0  # a removed engine's stop: asked, joined, then killed
_REMOVED_KEPT = 64  # removed engines still listed (an autoscaler can churn through many)
# An engine's stats that say what it holds now (a remote one's include its KV usage): a removed
# engine holds nothing.
_GAUGES = frozenset({*ENGINE_GAUGES, "num_free_pages", "num_cached_pages"})


@dataclass(frozen=True, slots=True)
class _Plan:
    """What apply_engines does, every check passed (names: engine names; ids: the pool's)."""

    wanted: dict[str, EngineEntry]  # the config's engines, by name, in its order
    current: dict[str, str]  # name -> id of the config's engines serving now
    changed: list[str]  # names whose entry changed: replaced
    leaving: list[str]  # ids removed once the new ones have started
    starting: dict[str, EngineEntry]  # name -> entry of the engines to start
    warning: str | None  # the fit check's, where the new CPU engines leave little memory


class EngineNameTaken(ValueError):
    """An engine added under a name a serving engine holds (HTTP: 409, not bad input)."""


@dataclass(slots=True)
class PoolEntry:
    """What the pool knows of one live engine beyond its handle."""

    name: str
    origin: str
    entry: EngineEntry | None  # None: a handle made elsewhere (the in-process engine, tests)
    draining: bool = False
    added_at: float = 0.0


class EnginePool:
    # The manager's tables and methods this mixin uses: _lost, _engine_lost, step_observer
    # (manager.py) and get_engine_status (status.py).
    handles: dict[str, EngineHandle]
    _outstanding: dict[str, dict[str, int]]
    _calls: dict[str, Call]
    coordinator: KVCoordinator
    config: RouterConfig
    engine_config: EngineConfig | None
    instance_id: str

    def _init_pool(self) -> None:
        self.pool: dict[str, PoolEntry] = {}  # engine id -> its entry, for every live engine
        self.removed: OrderedDict[str, dict[str, Any]] = OrderedDict()  # id -> last status
        self.running = False  # set by start(): an engine added from now on starts at once
        self._next_id = 0
        self._starts: dict[str, asyncio.Task] = {}
        self._removals: dict[str, asyncio.Task] = {}
        self._waiters: set[asyncio.Task] = set()  # removals waiting for their replacements
        self.autoscale = AutoscaleConfig()  # set before start() to turn the autoscaler on
        self.autoscaler: Autoscaler | None = None
        self.room = HostRoom()  # what local CPU engines added while serving must fit (room.py)

    # -- adding ------------------------------------------------------------------------------

    def add_engine(
        self,
        config: EngineEntry | EngineHandle,
        *,
        name: str | None = None,
        origin: str = "config",
    ) -> str:
        """Add an engine; returns its id. Before ``start`` it starts with the others; after, it
        starts now, in the background, and takes calls once healthy (``wait_started``)."""
        if origin not in ORIGINS:
            raise ValueError(f"origin must be one of {', '.join(ORIGINS)}")
        if isinstance(config, EngineHandle):
            handle, entry = config, None
            self._next_id = max(self._next_id, _numeric(handle.engine_id) + 1)
            name = name or f"engine-{handle.engine_id}"
        else:
            entry = config
            handle = self._build_handle(str(self._next_id), entry)
            self._next_id += 1
            name = name or first_free(base_name(entry), self._names_in_use())
        if handle.engine_id in self.handles or handle.engine_id in self.removed:
            raise ValueError(f"engine id {handle.engine_id!r} is already in use")
        if name in self._names_in_use():
            raise EngineNameTaken(f"an engine named {name!r} is already serving")
        handle.on_lost = self._engine_lost  # type: ignore[attr-defined]
        handle.step_observer = self.step_observer  # type: ignore[attr-defined]
        self.handles[handle.engine_id] = handle
        self._outstanding[handle.engine_id] = {}
        self.pool[handle.engine_id] = PoolEntry(name, origin, entry, added_at=time.monotonic())
        if self.running:
            log.info("engine %s (%s) added by %s: %s", handle.engine_id, name, origin, entry)
            self._share_threads()
            task = asyncio.get_running_loop().create_task(self._start_added(handle.engine_id))
            self._starts[handle.engine_id] = task
            task.add_done_callback(lambda _: self._starts.pop(handle.engine_id, None))
        return handle.engine_id

    def _build_handle(self, engine_id: str, entry: EngineEntry) -> EngineHandle:
        if entry.kind == "remote":
            from yaied.router.remote import RemoteHandle

            return RemoteHandle(engine_id, entry, self.config, instance_id=self.instance_id)
        if self.engine_config is None:
            raise ValueError(f"a {entry.kind} engine needs the manager's engine_config")
        if entry.kind == "ray":  # Ray is imported only here, and joined once per process
            from yaied.router.ray_handle import RayHandle

            return RayHandle(engine_id, entry, self.engine_config, self.config)
        from yaied.router.local_process import LocalProcessHandle

        return LocalProcessHandle(engine_id, entry, self.engine_config, self.config)

    def _share_threads(self) -> None:
        """Local engines without threads of their own divide the cores among them; one added
        later takes its share of the count then (the running ones keep theirs)."""
        local = [h for h in self.handles.values() if h.kind == "local"]
        for handle in local:
            if handle.health is Health.STARTING:
                handle.num_local_engines = len(local)  # type: ignore[attr-defined]

    async def _start_added(self, engine_id: str) -> None:
        handle, entry = self.handles[engine_id], self.pool[engine_id]
        try:
            await handle.start()
        except Exception as exc:
            log.error("engine %s (%s) failed to start, removed: %s", engine_id, entry.name, exc)
            await handle.stop(ENGINE_STOP_SECONDS)  # a process half up is killed
            self._retire(engine_id, error=str(exc))
            return
        later = "" if handle.health is Health.UP else " once up"  # a remote not probed up yet
        log.info("engine %s (%s) is %s: takes calls%s", engine_id, entry.name, handle.health, later)

    async def wait_started(self, engine_id: str) -> str:
        """Wait for an added engine's start to end; returns its state then."""
        task = self._starts.get(engine_id)
        if task is not None:
            await asyncio.wait({task})  # never raises: a failed start shows in the state
        return self.engine_state(engine_id)

    # -- draining and removing ---------------------------------------------------------------

    def drain_engine(self, engine_id: str) -> None:
        """No new calls go to the engine; those in flight finish there. Its sessions' pins are
        released, so their next calls route elsewhere (and build their cache there)."""
        entry = self._pool_entry(engine_id)
        if entry.draining:
            return
        entry.draining = True
        cleared = self.coordinator.engine_lost(engine_id)
        log.info(
            "engine %s (%s) draining: %d calls in flight, %d session pins released",
            engine_id,
            entry.name,
            len(self._outstanding[engine_id]),
            cleared,
        )

    def start_removal(self, engine_id: str, timeout: float = 30.0) -> asyncio.Task:
        """``remove_engine`` in the background (the HTTP route, a reload, the autoscaler); a
        second call for the same engine gets the first one's task."""
        self._pool_entry(engine_id)
        task = self._removals.get(engine_id)
        if task is None:
            self.drain_engine(engine_id)  # at once: no call routed there from now on
            task = asyncio.get_running_loop().create_task(self._remove(engine_id, timeout))
            self._removals[engine_id] = task
            task.add_done_callback(lambda _: self._removals.pop(engine_id, None))
        return task

    async def remove_engine(self, engine_id: str, timeout: float = 30.0) -> None:
        """Drain the engine, give its calls up to ``timeout`` seconds to finish, then stop it
        (within ENGINE_STOP_SECONDS more). A call still running then moves to another engine
        and goes on after the tokens it sent (an error event when none can take it)."""
        await asyncio.shield(self.start_removal(engine_id, timeout))

    async def _remove(self, engine_id: str, timeout: float) -> None:
        handle, name = self.handles[engine_id], self.pool[engine_id].name
        start = self._starts.get(engine_id)
        if start is not None:  # still loading: nothing to finish there
            start.cancel()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._outstanding[engine_id] and loop.time() < deadline:
            await asyncio.sleep(0.02)
        left = [self._calls[i] for i in list(self._outstanding[engine_id]) if i in self._calls]
        if left:
            log.warning(
                "engine %s (%s): %d calls still running after %.0f s; moving or ending them",
                engine_id,
                name,
                len(left),
                timeout,
            )
        for call in left:  # the same path as an engine lost: move it, else an error event
            self._lost(call, engine_id, call.num_moves, f"engine {engine_id} ({name}) was removed")
        last = handle.stats()  # a stopped process reports none: its counters stay on /metrics
        await handle.stop(ENGINE_STOP_SECONDS)  # events it still sends are dropped (stale)
        self._retire(engine_id, last_stats=last)
        handle.released()

    def _retire(
        self, engine_id: str, error: str | None = None, last_stats: Stats | None = None
    ) -> None:
        status = self.get_engine_status(engine_id).as_json()
        status["state"] = "removed"
        stats = status["stats"] or last_stats or {}
        # What it held at the end is held no more: the counters stay, frozen, the gauges go.
        status["stats"] = {k: v for k, v in stats.items() if k not in _GAUGES} or None
        if error is not None:
            status["error"] = error
        entry = self.pool.pop(engine_id)
        del self.handles[engine_id]
        del self._outstanding[engine_id]
        self.coordinator.engine_lost(engine_id)
        self.removed[engine_id] = status
        while len(self.removed) > _REMOVED_KEPT:
            self.removed.popitem(last=False)
        log.info("engine %s (%s) removed", engine_id, entry.name)

    def _start_autoscaler(self) -> None:
        if self.autoscale.enabled:
            self.autoscaler = Autoscaler(self, self.autoscale)  # type: ignore[arg-type]
            self.autoscaler.start()

    def _cancel_pool_tasks(self) -> None:
        """The daemon stops: starts and removals in progress give way to the stop itself."""
        if self.autoscaler is not None:
            self.autoscaler.stop()
        for task in [*self._starts.values(), *self._removals.values(), *self._waiters]:
            task.cancel()

    # -- the config's engines, as a diff by name (a reload) ----------------------------------

    def apply_engines(
        self, entries: Iterable[EngineEntry], timeout: float = 30.0
    ) -> dict[str, list[str]]:
        """Make the engines that came from the config match ``entries``, by name: new names
        start, missing ones are removed once the new ones have started (so the pool never
        shrinks to nothing in between), changed ones are replaced, the rest are untouched.
        Engines added over the API or by the autoscaler are not the config's, and stay. Every
        check runs before any change, new local CPU engines past the memory or the cores left now
        among them (room.py): a ValueError means nothing changed."""
        plan = self._plan_engines(list(entries))
        if plan.warning:
            log.warning("%s", plan.warning)
        current, wanted, changed = plan.current, plan.wanted, plan.changed
        for name in changed:  # its name goes to the new engine at once
            self.drain_engine(current[name])
        new = [self.add_engine(e, name=n, origin="config") for n, e in plan.starting.items()]
        if plan.leaving:
            task = asyncio.get_running_loop().create_task(
                self._remove_after_start(new, plan.leaving, timeout)
            )
            self._waiters.add(task)
            task.add_done_callback(self._waiters.discard)
        diff = {
            "added": [n for n in wanted if n not in current],
            "removed": [n for n in current if n not in wanted],
            "replaced": changed,
            "unchanged": [n for n in current if n in wanted and n not in changed],
        }
        log.info("engines from the config: %s", diff)
        return diff

    def check_engines(self, entries: Iterable[EngineEntry]) -> None:
        """apply_engines' checks alone, changing and logging nothing: a ValueError where
        ``entries`` cannot be applied now. A reload runs them before it starts or joins Ray."""
        self._plan_engines(list(entries))

    def _plan_engines(self, entries: list[EngineEntry]) -> _Plan:
        wanted = dict(zip(entry_names(entries), entries, strict=True))
        current = {
            e.name: i for i, e in self.pool.items() if e.origin == "config" and not e.draining
        }
        taken = self._names_in_use() - set(current)
        if clash := sorted(set(wanted) & taken):
            raise ValueError(f"engine names {clash} are held by engines not from the config")
        if self.engine_config is None and any(e.kind in ("local", "ray") for e in entries):
            raise ValueError("local and ray engines need the manager's engine_config")
        others = [i for i, e in self.pool.items() if e.origin != "config" and not e.draining]
        if not wanted and not others:
            raise ValueError("the config lists no engine: the daemon would have none")
        changed = [n for n in wanted if n in current and self.pool[current[n]].entry != wanted[n]]
        leaving = [current[n] for n in current if n not in wanted or n in changed]
        starting = {n: e for n, e in wanted.items() if n not in current or n in changed}
        fix = "the engines added, or at a restart cache.kv_cache_gib or model.quantization"
        what, where = "[[engines]] added by the reload", "engines.threads"
        warning = check_room(self, starting, what, fix, where=where, leaving=leaving)
        return _Plan(wanted, current, changed, leaving, starting, warning)

    async def _remove_after_start(self, new: list[str], leaving: list[str], timeout: float):
        await asyncio.gather(*(self.wait_started(i) for i in new), return_exceptions=True)
        await asyncio.gather(
            *(self.start_removal(i, timeout) for i in leaving if i in self.pool),
            return_exceptions=True,
        )

    # -- reading -----------------------------------------------------------------------------

    def engine_state(self, engine_id: str) -> str:
        """One of STATES."""
        if engine_id in self.removed:
            return "removed"
        handle, entry = self.handles[engine_id], self._pool_entry(engine_id)
        if entry.draining:
            return "draining"
        return {Health.STARTING: "starting", Health.UP: "up"}.get(handle.health, "down")

    def routable(self, engine_id: str) -> bool:
        """Whether new calls may go to the engine: up, and not draining."""
        return self.handles[engine_id].health is Health.UP and not self.pool[engine_id].draining

    def engine_counts(self) -> dict[str, int]:
        """Engines per state (every state present), for ``yaied:engines{state}``."""
        counts = Counter(self.engine_state(i) for i in self.handles)
        counts["removed"] = len(self.removed)
        return {state: counts.get(state, 0) for state in STATES}

    def find_engine(self, id_or_name: str) -> str:
        """An engine's id from its id or its (serving) name; ValueError when there is none."""
        if id_or_name in self.handles or id_or_name in self.removed:
            return id_or_name
        for engine_id, entry in self.pool.items():
            if entry.name == id_or_name and not entry.draining:
                return engine_id
        raise ValueError(f"no engine {id_or_name!r}")

    def _pool_entry(self, engine_id: str) -> PoolEntry:
        entry = self.pool.get(engine_id)
        if entry is None:
            gone = " (removed)" if engine_id in self.removed else ""
            raise ValueError(f"no engine {engine_id!r}{gone}")
        return entry

    def _names_in_use(self) -> set[str]:
        """Names of engines not on their way out: a draining engine's name may be taken again
        (a reload that replaces an engine under the same name)."""
        return {entry.name for entry in self.pool.values() if not entry.draining}


def _numeric(engine_id: str) -> int:
    return int(engine_id) if engine_id.isdecimal() else -1
