"""The autoscaler: local engines added when calls queue, removed when idle (`[autoscale]`, off by
default).

Each ``interval_seconds`` the loop reads the pool (a ``PoolSample``) and asks ``decide``, a pure
function of that sample, the settings and what it remembers from earlier samples:

    up    calls waiting (no token yet) per serving engine above ``scale_up_waiting_per_engine``
          for ``scale_up_window_seconds`` on end, and fewer than ``max_engines`` local engines
          (none still starting: a new engine's load is not counted twice)
    down  an engine the autoscaler added has had no call for ``scale_down_idle_seconds``, the
          queue is not high, and more than ``min_engines`` local engines remain
    min   fewer than ``min_engines`` local engines: up without waiting for a window
    room  an up whose local CPU engine does not fit the memory or cores left now (room.py, as a
          start is checked) is ``up_refused``: nothing added, no cooldown, the window kept, so
          it is added at the first sample with room; warned about and counted once an episode
    after an up or a down, nothing for ``cooldown_seconds``: a load near a threshold does not
          make the pool flap, and an engine that fails to start is not respawned at once

Only engines the autoscaler added are scaled down; the config's and the API's are the
operator's. A scale-down is a ``remove_engine``: its calls finish first. "Local" means not
remote: engine processes here, and the in-process engine. Decisions are logged and counted
(``events``, exported as ``yaied:autoscale_events_total{direction}``: up, down, up_refused).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from yaied.core.config import load_section, read_toml
from yaied.router.config import EngineEntry
from yaied.router.handle import EngineHandle
from yaied.router.ray_cluster import join_for
from yaied.router.room import NoRoom, check_room

log = logging.getLogger(__name__)
COUNTED = ("starting", "up", "down")  # states that count towards min and max (down: restarting)


@dataclass(frozen=True, slots=True)
class AutoscaleConfig:
    """The `[autoscale]` section of config/yaied.toml."""

    enabled: bool = False  # off by default: the pool is what the config and the API make it
    min_engines: int = 1  # local engines never fewer (the autoscaler adds up to it)
    max_engines: int = 4  # local engines never more
    scale_up_waiting_per_engine: float = 4.0  # calls without a token yet, per serving engine
    scale_up_window_seconds: float = 30.0  # ... above that this long on end: one engine more
    scale_down_idle_seconds: float = 300.0  # an added engine with no call this long: removed
    cooldown_seconds: float = 120.0  # after a scaling event, no other for this long
    interval_seconds: float = 1.0  # how often the pool is sampled
    device: str = "auto"  # what new engines run on (as [[engines]] device)
    threads: int = 0  # CPU threads of a new engine; 0 = the cores shared among local engines
    # local: a process on this machine; ray: an actor Ray places (its resources: {GPU = 1} on
    # device "cuda", else {CPU = threads or 1}), so a Ray cluster's autoscaler adds nodes
    kind: str = "local"
    node: str = ""  # ray: the node label (a custom resource) new engines must run on

    def __post_init__(self) -> None:
        if not 0 <= self.min_engines <= self.max_engines or self.max_engines < 1:
            raise ValueError("autoscale needs 0 <= min_engines <= max_engines, max_engines >= 1")
        for name in ("scale_up_waiting_per_engine", "interval_seconds"):
            if not getattr(self, name) > 0:
                raise ValueError(f"autoscale.{name} must be > 0")
        for name in ("scale_up_window_seconds", "scale_down_idle_seconds", "cooldown_seconds"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"autoscale.{name} must be >= 0")
        if self.kind not in ("local", "ray"):
            raise ValueError(f"autoscale.kind must be local or ray, got {self.kind!r}")
        self.new_entry()  # checks device, threads and node (and that Ray is there)

    def new_entry(self) -> EngineEntry:
        """The [[engines]] entry of an engine the autoscaler adds."""
        if self.kind == "local":
            return EngineEntry(device=self.device, threads=self.threads, node=self.node)
        gpu = self.device.startswith("cuda")
        resources = (("GPU", 1.0),) if gpu else (("CPU", float(self.threads or 1)),)
        device = "cuda" if gpu else self.device
        return EngineEntry(kind="ray", device=device, resources=resources, node=self.node)


def load_autoscale_config(
    path: str | Path | None = None, *, env: Mapping[str, str] | None = None
) -> AutoscaleConfig:
    """`[autoscale]`, then ``YAIED_AUTOSCALE_*``."""
    return load_section(AutoscaleConfig, "autoscale", read_toml(path), env, None)


@dataclass(frozen=True, slots=True)
class EngineSample:
    engine_id: str
    state: str  # the pool's: starting, up, draining, down
    num_calls: int  # calls routed there and not finished
    removable: bool  # added by the autoscaler: it may remove it


@dataclass(frozen=True, slots=True)
class PoolSample:
    now: float  # seconds, any monotonic clock
    num_waiting: int  # calls without a token yet, all engines
    num_serving: int  # engines taking calls (up, not draining), remote ones too
    local: tuple[EngineSample, ...]  # the local engines, draining ones too
    no_room: str | None = None  # why the engine an up adds would not fit now; None: it would


@dataclass(frozen=True, slots=True)
class Memory:
    """What ``decide`` carries from one sample to the next."""

    high_since: float | None = None  # when the queue went above the threshold
    idle_since: Mapping[str, float] = field(default_factory=dict)  # engine id -> since when
    last_event_at: float = float("-inf")


@dataclass(frozen=True, slots=True)
class Decision:
    direction: str  # up | down | up_refused (an up that does not fit: nothing added)
    engine_id: str | None  # down: the engine to remove
    reason: str


def decide(
    config: AutoscaleConfig, sample: PoolSample, memory: Memory
) -> tuple[Decision | None, Memory]:
    """The scaling decision for one sample, and the memory to pass with the next."""
    now = sample.now
    counted = [e for e in sample.local if e.state in COUNTED]
    per_engine = sample.num_waiting / max(1, sample.num_serving)
    high = per_engine > config.scale_up_waiting_per_engine
    high_since = (memory.high_since if memory.high_since is not None else now) if high else None
    idle_since = {
        e.engine_id: memory.idle_since.get(e.engine_id, now)
        for e in sample.local
        if e.state == "up" and e.num_calls == 0
    }
    memory = Memory(high_since, idle_since, memory.last_event_at)
    if now - memory.last_event_at < config.cooldown_seconds:
        return None, memory  # also between ups to min: an engine that fails to start is
    if len(counted) < config.min_engines:  # not respawned every interval
        if sample.no_room is not None:
            return Decision("up_refused", None, sample.no_room), memory
        reason = f"{len(counted)} local engines, min {config.min_engines}"
        return _event(now, "up", None, reason, memory)
    starting = any(e.state == "starting" for e in counted)
    if high_since is not None and now - high_since >= config.scale_up_window_seconds:
        if len(counted) < config.max_engines and not starting:
            if sample.no_room is not None:  # no event: the window holds until there is room
                return Decision("up_refused", None, sample.no_room), memory
            reason = f"{per_engine:.1f} calls waiting per engine for {now - high_since:.0f} s"
            return _event(now, "up", None, reason, dataclasses.replace(memory, high_since=None))
        return None, memory
    idle = [
        e
        for e in counted
        if e.removable and now - idle_since.get(e.engine_id, now) >= config.scale_down_idle_seconds
    ]
    if not high and idle and len(counted) > config.min_engines:
        victim = min(idle, key=lambda e: idle_since[e.engine_id])  # the longest idle
        reason = f"idle for {now - idle_since[victim.engine_id]:.0f} s"
        return _event(now, "down", victim.engine_id, reason, memory)
    return None, memory


def _event(
    now: float, direction: str, engine_id: str | None, reason: str, memory: Memory
) -> tuple[Decision, Memory]:
    return Decision(direction, engine_id, reason), dataclasses.replace(memory, last_event_at=now)


EngineFactory = Callable[[], EngineEntry | EngineHandle]


class Autoscaler:
    """The loop around ``decide``: samples the manager's pool, applies the decisions."""

    def __init__(
        self,
        manager: Any,  # the EngineManager (which imports this module: typed loosely)
        config: AutoscaleConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        new_engine: EngineFactory | None = None,  # tests: fake engines
    ) -> None:
        self.manager = manager
        self.config = config
        self.clock = clock
        self.new_engine = new_engine or config.new_entry
        self.memory = Memory()
        self.events: Counter[str] = Counter({"up": 0, "down": 0, "up_refused": 0})
        self._added = 0
        self._refusing = False  # the last decision was up_refused: warned and counted once
        self._task: asyncio.Task | None = None

    def sample(self) -> PoolSample:
        manager = self.manager
        local = tuple(
            EngineSample(
                engine_id,
                manager.engine_state(engine_id),
                len(manager._outstanding[engine_id]),
                manager.pool[engine_id].origin == "autoscale",
            )
            for engine_id, handle in manager.handles.items()
            if handle.kind != "remote"
        )
        serving = sum(manager.routable(engine_id) for engine_id in manager.handles)
        return PoolSample(self.clock(), manager.num_calls_waiting, serving, local)

    def tick(self) -> Decision | None:
        """One sample, one decision, applied: ``step`` without the Ray join (an engine that
        needs none: a local one, a test's fake)."""
        return self._apply(*self._decide())

    async def step(self) -> Decision | None:
        """``tick`` for the loop: a ray engine's cluster is joined (the first time, Ray starts:
        seconds) in a thread before it is added, so the streams go on meanwhile. One that
        cannot join is a ValueError, and the cooldown holds the next try back."""
        decision, engine = self._decide()
        if isinstance(engine, EngineEntry) and self.manager.engine_config is not None:
            size = self.manager.engine_config.engine.tensor_parallel_size
            await join_for(self.manager.config.ray_address, [engine], size)
        return self._apply(decision, engine)

    def _decide(self) -> tuple[Decision | None, EngineEntry | EngineHandle | None]:
        """One sample's decision (the memory carried on), and the engine an up adds. Whether
        that engine fits is read only when the sample says up (room.py reads /proc)."""
        sample = self.sample()
        decision, memory = decide(self.config, sample, self.memory)
        if decision is not None and decision.direction == "up":
            no_room = self._no_room()
            if no_room is not None:  # the same sample, told why: refused, the memory as before
                sample = dataclasses.replace(sample, no_room=no_room)
                decision, memory = decide(self.config, sample, self.memory)
        self.memory = memory
        up = decision is not None and decision.direction == "up"
        return decision, self.new_engine() if up else None

    def _no_room(self) -> str | None:
        """Why the local CPU engine an up adds does not fit this machine now, else None (a fit
        that leaves little memory is a warning). GPU and Ray engines are not checked here."""
        if self.config.kind != "local":
            return None
        name = f"auto-{self._added + 1}"
        fix = "autoscale.max_engines, or at a restart cache.kv_cache_gib or model.quantization"
        what = f"the autoscaler's engine {name}"
        try:
            entries = {name: self.config.new_entry()}
            warning = check_room(self.manager, entries, what, fix, where="autoscale.threads")
        except NoRoom as exc:
            return str(exc)
        if warning:
            log.warning("autoscale: %s", warning)
        return None

    def _apply(
        self, decision: Decision | None, engine: EngineEntry | EngineHandle | None
    ) -> Decision | None:
        refusing = self._refusing
        self._refusing = decision is not None and decision.direction == "up_refused"
        if decision is None:
            return None
        if decision.direction == "up_refused":
            if not refusing:  # once an episode: the ticks while it lasts say nothing new
                self.events["up_refused"] += 1
                log.warning("autoscale: no engine added until one fits: %s", decision.reason)
            return decision
        self.events[decision.direction] += 1
        if engine is not None:
            self._added += 1
            engine_id = self.manager.add_engine(
                engine, name=f"auto-{self._added}", origin="autoscale"
            )
            log.info("autoscale up: engine %s added (%s)", engine_id, decision.reason)
        else:
            assert decision.engine_id is not None
            self.manager.start_removal(decision.engine_id)
            log.info("autoscale down: engine %s removed (%s)", decision.engine_id, decision.reason)
        return decision

    async def run(self) -> None:
        while True:
            try:
                await self.step()
            except ValueError as exc:  # Ray that cannot be joined, resources no node has
                log.error("autoscale: no engine added: %s", exc)
            except Exception:  # a failed add (say, no engine_config) must not end the loop
                log.exception("autoscale: the decision could not be applied")
            await asyncio.sleep(self.config.interval_seconds)

    def start(self) -> None:
        log.info("autoscale on: %s", self.config)
        self._task = asyncio.get_running_loop().create_task(self.run(), name="yaied-autoscale")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
