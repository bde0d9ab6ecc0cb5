"""The router's status reports: per engine (``GET /v1/engines``), in all (``GET /v1/router``),
and the engines' counters summed (what /metrics and the queue check read), with what removed
engines counted (``removed_engine_counters``).

A mixin of `EngineManager`, kept apart so that the manager's file is about calls; it reads only
the manager's tables, never changes them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from yaied.core.metric_names import ENGINE_COUNTERS, RESTARTS_PREFIX
from yaied.router.handle import EngineHandle, EngineStatus, Stats
from yaied.router.lifecycle import CallState

if TYPE_CHECKING:
    from yaied.router.config import RouterConfig
    from yaied.router.kv_coordinator import KVCoordinator
    from yaied.router.lifecycle import LifecycleTracker
    from yaied.router.pool import PoolEntry


class ManagerStatus:
    handles: dict[str, EngineHandle]
    _outstanding: dict[str, dict[str, int]]
    coordinator: KVCoordinator
    lifecycle: LifecycleTracker
    config: RouterConfig
    pool: dict[str, PoolEntry]  # and engine_state: router/pool.py
    removed: dict[str, dict[str, Any]]

    def get_engine_status(self, engine_id: str) -> EngineStatus:
        handle = self.handles.get(engine_id)
        if handle is None:
            raise ValueError(f"no engine {engine_id!r}; engines: {', '.join(self.handles)}")
        outstanding = self._outstanding[engine_id]
        return EngineStatus(
            engine_id,
            handle.kind,
            handle.health.value,
            len(outstanding),
            sum(outstanding.values()),
            self.coordinator.engine_hit_rate(engine_id),
            handle.stats(),
            handle.describe(),
            self.pool[engine_id].name,
            self.engine_state(engine_id),
        )

    @property
    def recovering(self) -> bool:
        """Whether an engine that is not up will be with nobody acting (see
        EngineHandle.comes_back): what /health tells "restarting" from "dead" by. A draining
        engine is on its way out, not back."""
        return any(
            not self.pool[i].draining and handle.comes_back() for i, handle in self.handles.items()
        )

    def engine_listing(self) -> list[dict[str, Any]]:
        """Every engine, live then recently removed (``GET /v1/engines``)."""
        live = [self.get_engine_status(i).as_json() for i in self.handles]
        return live + list(self.removed.values())

    def hardware(self) -> dict[str, Any]:
        """What the engines run on, for /health: their devices and the ISA level of their CPU
        kernels (one value where all agree, else every engine's)."""
        infos = {i: h.info for i, h in self.handles.items() if h.info is not None}
        report: dict[str, Any] = {}
        for field in (
            "device",
            "dtype",
            "weight_dtype",
            "kv_cache_dtype",
            "quantization",
            "cpu_isa",
        ):
            values = {i: getattr(info, field) for i, info in infos.items() if getattr(info, field)}
            if values:
                distinct = set(values.values())
                report[field] = distinct.pop() if len(distinct) == 1 else values
        return report

    def autoscale_events(self) -> dict[str, int]:
        """Scaling events so far by direction (``yaied:autoscale_events_total``)."""
        scaler = getattr(self, "autoscaler", None)
        none = {"up": 0, "down": 0, "up_refused": 0}
        return none if scaler is None else dict(scaler.events)

    def get_stats(self) -> dict[str, Any]:
        live = self.lifecycle.live()
        totals = self.coordinator.totals()
        return {
            "policy": self.config.policy,
            "engines": [self.get_engine_status(i).as_json() for i in self.handles],
            "num_requests_pending": sum(r.state is CallState.PENDING for r in live),
            "num_requests_running": sum(r.state is CallState.RUNNING for r in live),
            "num_sessions": self.coordinator.num_sessions,
            "prompt_tokens": totals.num_prompt_tokens,
            "cached_tokens": totals.num_cached_tokens,
            "hit_rate": totals.hit_rate,
        }

    def engine_stats(self) -> dict[str, Stats]:
        """Engine id -> its counters, for the engines that report them (the /metrics gauges)."""
        stats = {engine_id: handle.stats() for engine_id, handle in self.handles.items()}
        return {engine_id: s for engine_id, s in stats.items() if s is not None}

    def removed_engine_counters(self) -> dict[str, Stats]:
        """Engine id -> the counters a removed engine reported last (its own, ENGINE_COUNTERS,
        and its restarts), for the removed engines still listed: /metrics keeps them, frozen, as
        it keeps the server's counters of that engine, so a sum over engines never drops. One
        no longer listed (pool.py keeps the last _REMOVED_KEPT) leaves /metrics altogether."""
        kept = {}
        for engine_id, status in self.removed.items():
            stats = status.get("stats") or {}
            counters = {k: v for k, v in stats.items() if _is_counter(k)}
            if counters:
                kept[engine_id] = counters
        return kept

    def listed_engines(self) -> set[str]:
        """The engines GET /v1/engines lists: live, and recently removed."""
        return {*self.handles, *self.removed}

    def stats(self) -> Stats:
        """Every engine's counters summed (what a single engine's stats() said)."""
        total: Stats = {}
        for stats in self.engine_stats().values():
            for key, value in stats.items():
                total[key] = total.get(key, 0) + value
        total.setdefault("num_requests_waiting", 0)
        return total


def _is_counter(key: str) -> bool:
    return key in ENGINE_COUNTERS or key.startswith(RESTARTS_PREFIX)
