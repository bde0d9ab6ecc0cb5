"""The autoscaler: ``decide`` over scripted traces (a pool model that applies its decisions at
once), and the loop around it over fake engines with a fake clock."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from tests.router.test_manager import FakeEngine, params, started
from yaied.core.config import load_config
from yaied.core.host_memory import GIB
from yaied.core.model_info import ModelInfo
from yaied.engine.inputs import InputProcessor
from yaied.router.autoscale import (
    AutoscaleConfig,
    Autoscaler,
    Decision,
    EngineSample,
    Memory,
    PoolSample,
    decide,
    load_autoscale_config,
)
from yaied.router.config import RouterConfig
from yaied.router.manager import EngineManager
from yaied.router.room import HostRoom
from yaied.server.metrics import ServerMetrics

pytestmark = pytest.mark.timeout(30)
CONFIG = AutoscaleConfig(
    enabled=True,
    min_engines=1,
    max_engines=3,
    scale_up_waiting_per_engine=2.0,
    scale_up_window_seconds=10.0,
    scale_down_idle_seconds=20.0,
    cooldown_seconds=30.0,
)


@dataclass
class Pool:
    """A pool whose engines come up the moment they are added; one fixed engine "0"."""

    engines: dict[str, int] = field(default_factory=lambda: {"0": 0})  # id -> calls
    added: int = 0
    events: list[tuple[float, str]] = field(default_factory=list)
    memory: Memory = field(default_factory=Memory)

    def step(self, now: float, waiting: int, busy: bool, config=CONFIG) -> None:
        local = tuple(
            EngineSample(i, "up", calls if not busy else 1, i != "0")
            for i, calls in self.engines.items()
        )
        sample = PoolSample(now, waiting, len(self.engines), local)
        decision, self.memory = decide(config, sample, self.memory)
        if decision is None:
            return
        self.events.append((now, decision.direction))
        if decision.direction == "up":
            self.added += 1
            self.engines[str(self.added)] = 0
        else:
            del self.engines[decision.engine_id]
        assert config.min_engines <= len(self.engines) <= config.max_engines

    def run(self, trace: list[tuple[float, float, int, bool]]) -> None:
        """trace: (from, to, waiting calls, engines busy), one sample a second."""
        for start, end, waiting, busy in trace:
            now = start
            while now < end:
                self.step(now, waiting, busy)
                now += 1.0


def test_up_only_after_the_queue_stays_high_for_the_window():
    pool = Pool()
    pool.run([(0, 5, 10, True), (5, 8, 0, True), (8, 17, 10, True)])  # a spike: 5 s, then 9 s
    assert pool.events == []
    pool.run([(17, 19, 10, True)])
    assert pool.events == [(18, "up")]  # 10 s above 2 per engine, from t=8


def test_no_second_event_within_the_cooldown_and_never_above_max():
    pool = Pool()
    pool.run([(0, 200, 50, True)])  # a queue that never drains
    assert pool.events == [(10, "up"), (40, "up")]  # cooldown 30 s; then max (3) is reached
    assert len(pool.engines) == 3


def test_down_when_idle_never_below_min_and_never_the_fixed_engine():
    pool = Pool()
    pool.run([(0, 41, 50, True)])
    assert len(pool.engines) == 3
    pool.run([(41, 300, 0, False)])  # all idle from t=41
    assert [e for e in pool.events if e[1] == "down"] == [(70, "down"), (100, "down")]
    assert list(pool.engines) == ["0"]  # min 1, and "0" is not the autoscaler's


def test_a_load_near_the_threshold_does_not_flap():
    pool = Pool()
    # 12 s high, 25 s idle, 12 s high, 25 s idle...: the cooldown spaces events 30 s apart.
    trace = []
    for cycle in range(6):
        t = cycle * 37
        trace += [(t, t + 12, 10, True), (t + 12, t + 37, 0, False)]
    pool.run(trace)
    times = [t for t, _ in pool.events]
    assert all(b - a >= CONFIG.cooldown_seconds for a, b in zip(times, times[1:], strict=False))


def test_fewer_than_min_adds_at_once_and_a_starting_engine_holds_the_next_up():
    config = AutoscaleConfig(min_engines=2, max_engines=4, cooldown_seconds=0)
    sample = PoolSample(0.0, 0, 1, (EngineSample("0", "up", 0, False),))
    decision, memory = decide(config, sample, Memory())
    assert decision is not None and decision.direction == "up"
    starting = (EngineSample("0", "up", 5, False), EngineSample("1", "starting", 0, True))
    high = Memory(high_since=-100.0)
    assert decide(config, PoolSample(1.0, 100, 1, starting), high)[0] is None


def test_config_is_checked_and_read_from_its_section(tmp_path):
    with pytest.raises(ValueError, match="min_engines"):
        AutoscaleConfig(min_engines=3, max_engines=2)
    path = tmp_path / "yaied.toml"
    path.write_text("[autoscale]\nenabled = true\nmax_engines = 2\n")
    config = load_autoscale_config(path, env={"YAIED_AUTOSCALE_MIN_ENGINES": "0"})
    assert (config.enabled, config.min_engines, config.max_engines) == (True, 0, 2)
    assert not AutoscaleConfig().enabled  # off by default


async def test_the_loop_scales_a_manager_up_and_down_on_a_fake_clock():
    manager, engines = await started(1)
    engines[0].tick = 0.3  # no token before the first await: the calls wait through the ticks
    now = [0.0]
    scaler = Autoscaler(
        manager, CONFIG, clock=lambda: now[0], new_engine=lambda: FakeEngine(manager_next(manager))
    )
    waiting = [await manager.submit_request(prompt=[1], sampling_params=params()) for _ in range(6)]
    for t in range(0, 11):
        now[0] = float(t)
        decision = scaler.tick()
    assert decision is not None and decision.direction == "up"
    assert manager.pool["1"].name == "auto-1" and manager.pool["1"].origin == "autoscale"
    assert await manager.wait_started("1") == "up"
    for handle in waiting:
        await manager.cancel_request(handle.request_id)
    await asyncio.gather(*(handle.result() for handle in waiting))
    for t in range(11, 80):
        now[0] = float(t)
        scaler.tick()
    assert scaler.events == {"up": 1, "down": 1, "up_refused": 0}
    await asyncio.gather(*list(manager._removals.values()))
    assert manager.engine_state("1") == "removed" and manager.engine_state("0") == "up"
    manager.autoscaler = scaler
    metrics = ServerMetrics(
        "m",
        lambda: {},
        pool_stats=lambda: (
            manager.engine_counts(),
            manager.autoscale_events(),
            manager.migrations,
        ),
    )
    text = metrics.render().decode()
    assert 'yaied:engines{model_name="m",state="removed"} 1.0' in text
    assert 'yaied:autoscale_events_total{direction="up",model_name="m"} 1.0' in text
    manager.autoscaler = None
    await manager.stop()


def manager_next(manager) -> str:
    return str(manager._next_id)


async def test_an_enabled_autoscaler_runs_with_the_manager_and_stops_with_it():
    manager, _ = await started(1)
    assert manager.autoscaler is None  # off by default
    await manager.stop()
    manager = EngineManager(RouterConfig())
    manager.add_engine(FakeEngine("0"))
    manager.inputs = InputProcessor(None, SimpleNamespace(eos_token_id=None), ModelInfo(64, 8))
    manager.autoscale = AutoscaleConfig(enabled=True, min_engines=1, max_engines=1)
    await manager.start()
    task = manager.autoscaler._task
    assert task is not None and not task.done()
    await manager.stop()
    await asyncio.sleep(0)
    assert task.cancelled()


def test_shipped_toml_lists_every_autoscale_setting_at_its_default():
    from pathlib import Path

    shipped = Path(__file__).resolve().parents[2] / "config" / "yaied.toml"
    text = shipped.read_text()
    assert load_autoscale_config(shipped, env={}) == AutoscaleConfig()
    section = text.split("[autoscale]", 1)[1].split("\n[", 1)[0]
    for name in AutoscaleConfig.__dataclass_fields__:
        assert f"\n{name} = " in section, name


def test_readme_table_names_every_autoscale_setting():
    # The README's "[autoscale] setting" table is where a reader looks for them.
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    table = readme.split("| `[autoscale]` setting |", 1)[1].split("\n\n", 1)[0]
    named = set(re.findall(r"`(\w+)`", table))
    missing = [name for name in AutoscaleConfig.__dataclass_fields__ if name not in named]
    assert not missing, f"README's [autoscale] table lacks {missing}"


def test_an_up_with_no_room_adds_nothing_and_keeps_the_window_and_no_cooldown():
    """decide: the sample says why an engine would not fit; the up waits for room, not for a
    cooldown or another window."""
    sample = PoolSample(100.0, 50, 1, (EngineSample("0", "up", 9, False),), no_room="no memory")
    decision, memory = decide(CONFIG, sample, Memory(high_since=0.0))
    assert decision == Decision("up_refused", None, "no memory")
    assert memory.high_since == 0.0 and memory.last_event_at == float("-inf")
    roomy = dataclasses.replace(sample, now=101.0, no_room=None)
    assert decide(CONFIG, roomy, memory)[0].direction == "up"  # at once, once there is room
    below_min = PoolSample(0.0, 0, 0, (), no_room="no memory")
    assert decide(CONFIG, below_min, Memory())[0].direction == "up_refused"


async def test_a_scale_up_past_the_memory_left_adds_nothing_warns_once_and_counts_once(caplog):
    """Its ups started local CPU engines whatever the machine had left: past the memory, the
    OOM killer ended one mid-serve. Checked as a start is, against what is left now."""
    manager, engines = await started(1)
    manager.engine_config = load_config(
        env={}, overrides={"device.device": "cpu", "cache.kv_cache_gib": 2.0}
    )
    engines[0].tick = 0.3
    now = [0.0]
    config = dataclasses.replace(CONFIG, device="cpu")
    added: list[str] = []

    def new_engine() -> FakeEngine:
        added.append(manager_next(manager))
        return FakeEngine(added[-1])

    scaler = Autoscaler(manager, config, clock=lambda: now[0], new_engine=new_engine)
    # 1 GiB of weights + a 2 GiB KV pool + 256 MiB a process at the least, in 3 GiB
    available = [3 * GIB]
    manager.room = HostRoom(GIB, available=lambda: available[0], cores=lambda: 8)
    waiting = [await manager.submit_request(prompt=[1], sampling_params=params()) for _ in range(6)]
    with caplog.at_level(logging.WARNING, logger="yaied.router.autoscale"):
        for t in range(0, 40):
            now[0] = float(t)
            scaler.tick()
    assert added == [] and list(manager.pool) == ["0"]
    refusals = [r.getMessage() for r in caplog.records if "no engine added" in r.getMessage()]
    assert len(refusals) == 1, refusals  # once for the episode, not every tick
    assert "the 3.0 GiB of memory available" in refusals[0]
    assert scaler.events == {"up": 0, "down": 0, "up_refused": 1}
    available[0] = 64 * GIB  # an engine elsewhere on the machine ended: room again
    now[0] = 40.0
    decision = scaler.tick()
    assert decision is not None and decision.direction == "up" and added == ["1"]
    assert scaler.events == {"up": 1, "down": 0, "up_refused": 1}
    for handle in waiting:
        await manager.cancel_request(handle.request_id)
    await manager.stop()
