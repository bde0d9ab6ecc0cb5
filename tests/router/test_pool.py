"""The elastic pool over fake engines: add while serving, drain, remove with a timeout, names,
ids, states (router/pool.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from tests.router.test_manager import FakeEngine, params, started
from tests.waiting import async_wait_until
from yaied.core.config import load_config
from yaied.core.host_memory import GIB
from yaied.core.model_info import ModelInfo
from yaied.core.request import FinishReason
from yaied.engine.inputs import InputProcessor
from yaied.router.config import EngineEntry, RouterConfig
from yaied.router.handle import Health
from yaied.router.lifecycle import CallState
from yaied.router.manager import EngineManager
from yaied.router.pool import entry_names
from yaied.router.room import HostRoom

pytestmark = pytest.mark.timeout(30)


class SlowStart(FakeEngine):
    """Takes ``delay`` seconds to come up, like a process loading a model; with a ``gate``, comes
    up only once the test opens it."""

    def __init__(
        self,
        engine_id: str,
        delay: float = 0.2,
        fail: bool = False,
        gate: asyncio.Event | None = None,
    ) -> None:
        super().__init__(engine_id)
        self.delay, self.fail, self.gate = delay, fail, gate
        self.stopped = False
        self.loading = False

    async def start(self) -> None:
        self.loading = True
        await asyncio.sleep(self.delay)
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            raise RuntimeError("the model does not load")
        self.health = Health.UP

    async def stop(self, timeout: float = 15.0) -> None:
        self.stopped = True
        await super().stop(timeout)


async def test_an_added_engine_joins_routing_once_up():
    # The long call held engine 0 for 20 ticks of 0.01 s while engine 1 took 0.2 s to start: the
    # two timers fell due together whenever the loop woke a little late, the long call ended
    # first, and one of the later calls went to an idle engine 0 (1 run in 6). Now engine 1
    # comes up when the test says so, and the long call outlasts the test: it is cancelled.
    manager, engines = await started(1)
    gate = asyncio.Event()
    new = SlowStart("1", delay=0, gate=gate)
    assert manager.add_engine(new, origin="api") == "1"
    await async_wait_until(lambda: new.loading, timeout=10, what="the start")
    assert manager.engine_state("1") == "starting"
    long = await manager.submit_request(prompt=[1], sampling_params=params(8000))  # 80 s of ticks
    short = await manager.submit_request(prompt=[1], sampling_params=params())
    assert (long.engine_id, short.engine_id) == ("0", "0")  # not routed while starting
    gate.set()
    assert await manager.wait_started("1") == "up"
    assert manager.lifecycle.get(long.request_id).state in (CallState.PENDING, CallState.RUNNING)
    after = [await manager.submit_request(prompt=[1], sampling_params=params()) for _ in range(2)]
    assert {h.engine_id for h in after} == {"1"}  # engine 0 has the long call: least loaded
    assert all(o.finish_reason is FinishReason.LENGTH for o in await gather([short, *after]))
    await long.cancel()
    assert (await long.result()).finish_reason is FinishReason.ABORT
    assert manager.migrations["moved"] == 0  # none was offered to an engine not up yet
    await manager.stop()


class StartsDown(FakeEngine):
    """A remote daemon that answered no probe yet: its start ends with the engine down."""

    async def start(self) -> None:
        self.health = Health.DOWN


@pytest.mark.parametrize(
    ("engine", "state", "line"),
    [(StartsDown, "down", "down: takes calls once up"), (SlowStart, "up", "up: takes calls\n")],
)
async def test_an_added_engine_that_starts_down_is_not_logged_as_taking_calls(
    caplog, engine, state, line
):
    """The log said "is down: it takes calls" of a remote not yet probed up, which takes none."""
    manager, _ = await started(1)
    with caplog.at_level("INFO", logger="yaied.router.pool"):
        manager.add_engine(engine("1"), origin="api")
        assert await manager.wait_started("1") == state
    assert f"engine 1 (engine-1) is {line}" in caplog.text, caplog.text
    await manager.stop()


async def test_an_engine_that_fails_to_start_is_removed_with_its_error():
    manager, _ = await started(1)
    manager.add_engine(SlowStart("1", delay=0.01, fail=True), origin="api")
    assert await manager.wait_started("1") == "removed"
    listing = manager.engine_listing()
    assert [(e["id"], e["state"]) for e in listing] == [("0", "up"), ("1", "removed")]
    assert "does not load" in listing[1]["error"]
    await manager.stop()


async def test_drain_finishes_in_flight_calls_sends_new_ones_elsewhere_and_releases_pins():
    manager, engines = await started(2, long_call_threshold=2)
    long_prompt = [1, 2, 3, 4]
    first = await manager.submit_request(session_id="s", prompt=long_prompt)
    await first.result()
    pinned = first.engine_id
    running = await manager.submit_request(prompt=[1], sampling_params=params(30))
    manager.drain_engine(pinned)
    assert manager.engine_state(pinned) == "draining"
    assert manager.coordinator.pin_of("s") is None  # the session's next call goes elsewhere
    later = [await manager.submit_request(prompt=[1], sampling_params=params()) for _ in range(3)]
    turn = await manager.submit_request(session_id="s", prompt=long_prompt)
    assert {h.engine_id for h in [*later, turn]} == {"1" if pinned == "0" else "0"}
    outputs = await gather([running, *later, turn])
    assert all(o.finish_reason is FinishReason.LENGTH for o in outputs)
    await manager.stop()


async def test_remove_waits_for_calls_then_stops_the_engine_and_never_reuses_its_id():
    manager, engines = await started(2)
    calls = [await manager.submit_request(prompt=[1], sampling_params=params(10)) for _ in range(4)]
    removal = manager.start_removal("0", timeout=5.0)
    assert manager.engine_state("0") == "draining"
    outputs = await gather(calls)
    assert all(o.finish_reason is FinishReason.LENGTH for o in outputs)  # none cut short
    await removal
    assert "0" not in manager.handles and engines[0].health is Health.STOPPED
    assert manager.engine_state("0") == "removed"
    assert manager.engine_counts() == {
        "starting": 0,
        "up": 1,
        "draining": 0,
        "down": 0,
        "removed": 1,
    }
    third = manager.add_engine(FakeEngine("2"))
    assert third == "2"
    with pytest.raises(ValueError, match="already in use"):
        manager.add_engine(FakeEngine("0"))  # a removed id stays retired
    with pytest.raises(ValueError, match="removed"):
        manager.drain_engine("0")
    await manager.stop()


async def test_calls_left_at_the_timeout_are_retried_or_ended_with_an_error():
    manager, engines = await started(2)
    engines[0].tick = 0.05
    streaming = await manager.submit_request(prompt=[1], sampling_params=params(200))
    assert streaming.engine_id == "0"
    await async_wait_until(  # it has streamed a token: a fake engine cannot resume it
        lambda: manager.lifecycle.get(streaming.request_id).state is CallState.RUNNING,
        timeout=10,
        what="the first token",
    )
    waiting = await manager.submit_request(prompt=[1], sampling_params=params(5))
    assert waiting.engine_id == "1"
    engines[1].health = Health.STARTING  # engine 1 takes nothing for now
    queued = await manager.submit_request(prompt=[1], sampling_params=params(5))
    assert queued.engine_id == "0"
    engines[0].tick = 10.0  # the queued call has no token yet
    engines[1].health = Health.UP
    await manager.remove_engine("0", timeout=0.2)
    out_streaming, out_queued = await gather([streaming, queued])
    assert out_streaming.finish_reason is FinishReason.ERROR
    assert "was removed" in manager.lifecycle.get(streaming.request_id).error
    assert out_queued.finish_reason is FinishReason.LENGTH  # retried on engine 1
    assert manager.lifecycle.get(queued.request_id).engine_id == "1"
    assert (await waiting.result()).finish_reason is FinishReason.LENGTH
    assert manager.num_requests_in_flight == 0
    await manager.stop()


async def test_removing_an_engine_still_starting_stops_it():
    manager, _ = await started(1)
    slow = SlowStart("1", delay=5.0)
    manager.add_engine(slow)
    await manager.remove_engine("1", timeout=1.0)
    assert slow.stopped and manager.engine_state("1") == "removed"
    await manager.stop()


async def test_names_are_unique_among_serving_engines_and_found_by_find_engine():
    manager, _ = await started(1)
    manager.add_engine(FakeEngine("1"), name="box-b")
    with pytest.raises(ValueError, match="already serving"):
        manager.add_engine(FakeEngine("2"), name="box-b")
    assert manager.find_engine("box-b") == "1" and manager.find_engine("1") == "1"
    manager.drain_engine("1")
    manager.add_engine(FakeEngine("3"), name="box-b")  # replaces the draining one
    assert manager.find_engine("box-b") == "3"
    with pytest.raises(ValueError, match="no engine"):
        manager.find_engine("nope")
    await manager.stop()


def test_generated_names_are_stable_for_one_config():
    entries = [
        EngineEntry(device="cpu"),
        EngineEntry(device="cpu"),
        EngineEntry(kind="remote", url="http://10.0.0.2:8000"),
        EngineEntry(device="cuda:1", name="big"),
    ]
    assert entry_names(entries) == ["local-cpu", "local-cpu-2", "remote-10.0.0.2:8000", "big"]
    with pytest.raises(ValueError, match="share a name"):
        entry_names([EngineEntry(name="a"), EngineEntry(name="a")])
    with pytest.raises(ValueError, match="engines.name"):
        EngineEntry(name="no spaces")


async def gather(handles):
    return await asyncio.gather(*(h.result() for h in handles))


def remote(name: str, port: int) -> EngineEntry:
    return EngineEntry(kind="remote", url=f"http://127.0.0.1:{port}", name=name)  # nobody there


async def test_apply_engines_is_a_diff_by_name_of_the_config_engines():
    manager = EngineManager(RouterConfig())
    manager.add_engine(FakeEngine("0"), origin="builtin")  # not the config's: never touched
    manager.inputs = InputProcessor(None, SimpleNamespace(eos_token_id=None), ModelInfo(64, 8))
    await manager.start()

    async def apply(*entries: EngineEntry) -> dict[str, list[str]]:
        diff = manager.apply_engines(entries, timeout=1.0)
        await asyncio.gather(*list(manager._waiters), *list(manager._starts.values()))
        return diff

    assert (await apply(remote("a", 9), remote("b", 10)))["added"] == ["a", "b"]
    ids = {e.name: i for i, e in manager.pool.items()}
    diff = await apply(remote("b", 10), remote("c", 11))
    assert diff == {"added": ["c"], "removed": ["a"], "replaced": [], "unchanged": ["b"]}
    assert manager.engine_state(ids["a"]) == "removed"
    assert manager.find_engine("b") == ids["b"]  # untouched: the same engine
    diff = await apply(remote("b", 12))  # b moved: a new engine under its name
    assert (diff["replaced"], diff["removed"]) == (["b"], ["c"])
    assert manager.find_engine("b") not in ids.values()
    before = dict(manager.pool)
    with pytest.raises(ValueError, match="share a name"):
        manager.apply_engines([remote("x", 9), remote("x", 10)])
    assert manager.pool == before  # nothing changed
    await apply()  # the builtin engine stays, so an empty list is allowed
    assert [e.name for e in manager.pool.values()] == ["engine-0"]
    await manager.stop()


async def test_a_removed_engine_is_listed_with_its_counters_and_no_gauges():
    # GET /v1/engines kept a removed engine's last gauges: "num_requests_running": 4 and its KV
    # pages in use, forever, for an engine that holds nothing any more (/metrics drops them).
    manager, engines = await started(2)
    engines[0].tick = 10.0  # the call is still running there when the engine goes
    engines[0].stats = lambda: {
        "num_requests_running": 1,
        "num_requests_waiting": 2,
        "num_free_pages": 3,
        "num_cached_pages": 4,
        "num_pages": 8,
        "prefix_cache_hits": 7,
        "kv_cache_usage_perc": 0.5,  # what a remote engine's stats hold
    }
    call = await manager.submit_request(prompt=[1], sampling_params=params(5))
    assert call.engine_id == "0"
    await manager.remove_engine("0", timeout=0)
    listed = {e["id"]: e for e in manager.engine_listing()}
    assert listed["0"]["state"] == "removed"
    assert listed["0"]["stats"] == {"num_pages": 8, "prefix_cache_hits": 7}  # frozen
    assert (await call.result()).finish_reason is FinishReason.LENGTH  # moved to engine 1
    await manager.stop()


async def test_a_reload_past_the_memory_or_cores_left_changes_nothing(monkeypatch):
    """A reload started its new local CPU engines whatever the machine had left: past the memory,
    the OOM killer ended one mid-serve. Checked as a start is, before any change."""
    config = load_config(env={}, overrides={"device.device": "cpu", "cache.kv_cache_gib": 2.0})
    manager = EngineManager(RouterConfig(), engine_config=config)
    gate = asyncio.Event()
    monkeypatch.setattr(manager, "_build_handle", lambda i, e: SlowStart(i, delay=0, gate=gate))
    manager.add_engine(EngineEntry(device="cpu", name="a"))
    manager.inputs = InputProcessor(None, SimpleNamespace(eos_token_id=None), ModelInfo(64, 8))
    gate.set()
    await manager.start()
    gate.clear()

    def cpu(name: str, threads: int = 0) -> EngineEntry:
        return EngineEntry(device="cpu", name=name, threads=threads)

    def room(available: int, cores: int) -> None:
        manager.room = HostRoom(GIB, available=lambda: available, cores=lambda: cores)

    before = dict(manager.pool)
    room(6 * GIB, 8)  # a new engine: 1 GiB weights + 2 GiB KV pool + 256 MiB at the least
    with pytest.raises(ValueError, match=r"^\[\[engines\]\] added by the reload: 2 CPU en"):
        manager.apply_engines([cpu("a"), cpu("b"), cpu("c")])
    room(64 * GIB, 2)
    with pytest.raises(ValueError, match=r"^3 local CPU engines need 3 cores \(a: 1, b: 1"):
        manager.apply_engines([cpu("a"), cpu("b"), cpu("c")])
    assert manager.pool == before and not manager.pool["0"].draining  # nothing changed
    # A replaced engine's cores go to its replacement: a (1) becomes a (2), b (1) joins.
    room(64 * GIB, 3)
    assert manager.apply_engines([cpu("a", threads=2), cpu("b")])["replaced"] == ["a"]
    # Those two still load: their memory is not taken yet, so it is counted with c's.
    room(4 * GIB, 8)
    with pytest.raises(ValueError, match=r"\(with 2 starting or restarting"):
        manager.apply_engines([cpu("a", threads=2), cpu("b"), cpu("c")])
    room(10 * GIB, 8)
    assert manager.apply_engines([cpu("a", threads=2), cpu("b"), cpu("c")])["added"] == ["c"]
    gate.set()
    await manager.stop()
