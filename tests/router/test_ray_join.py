"""A config reload or the autoscaler adding the first Ray engine: joining Ray (ray.init, seconds
for a local instance) runs in a thread, never on the event loop, so streams and /health go on.
Ray itself is faked here (tests/router/test_ray_http.py starts a real one for the HTTP route)."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from tests.router.test_manager import FakeEngine, started
from yaied.router import ray_cluster, ray_handle
from yaied.router.autoscale import AutoscaleConfig, Autoscaler
from yaied.router.config import EngineEntry
from yaied.server.config import ServerConfig
from yaied.server.keys import KeyTable
from yaied.server.reload import DaemonConfig, reload

pytestmark = pytest.mark.timeout(30)  # Ray is faked: these run where it is not installed too
JOIN_SECONDS = 0.6  # what the fake ray.init blocks for


class FakeRay:
    """Ray's connect: the first call blocks its thread, as ray.init starting Ray does."""

    def __init__(self) -> None:
        self.joined = False
        self.threads: list[int] = []  # the threads that waited for the join

    def connect(self, address: str) -> SimpleNamespace:
        if not self.joined:
            self.threads.append(threading.get_ident())
            time.sleep(JOIN_SECONDS)
            self.joined = True
        return SimpleNamespace()


@pytest.fixture
def fake_ray(monkeypatch) -> FakeRay:
    ray = FakeRay()
    monkeypatch.setattr(ray_cluster, "connect", ray.connect)
    monkeypatch.setattr(ray_cluster, "check_feasible", lambda *args: None)

    class FakeRayHandle(FakeEngine):  # what RayHandle does on the loop: connect, and no more
        kind = "ray"

        def __init__(self, engine_id, entry, engine_config, router_config) -> None:
            super().__init__(engine_id)
            ray_cluster.connect(router_config.ray_address)

    monkeypatch.setattr(ray_handle, "RayHandle", FakeRayHandle)
    return ray


async def longest_stall(until: asyncio.Future) -> float:
    """The longest the loop went without running this task, until ``until`` is done."""
    loop, longest = asyncio.get_running_loop(), 0.0
    while not until.done():
        before = loop.time()
        await asyncio.sleep(0.01)
        longest = max(longest, loop.time() - before - 0.01)
    return longest


async def with_engine_config():
    manager, _ = await started(1)
    manager.engine_config = SimpleNamespace(engine=SimpleNamespace(tensor_parallel_size=1))
    return manager


async def test_a_reload_that_adds_a_ray_engine_joins_ray_off_the_loop(fake_ray):
    manager = await with_engine_config()
    server = SimpleNamespace(
        manager=manager, draining=False, config=ServerConfig(), keys=KeyTable.parse(())
    )
    entries = (EngineEntry(kind="ray", name="on-ray"),)
    config = DaemonConfig(ServerConfig(), manager.config, entries, AutoscaleConfig())
    done = asyncio.get_running_loop().create_task(reload(server, lambda: config))
    stall = await longest_stall(done)
    assert await done
    assert threading.get_ident() not in fake_ray.threads and fake_ray.joined
    assert stall < JOIN_SECONDS / 2, f"the loop stalled {stall:.2f} s"
    assert "on-ray" in [e.name for e in manager.pool.values()]
    await manager.stop()


async def test_the_autoscaler_joins_ray_off_the_loop(fake_ray):
    manager = await with_engine_config()
    config = AutoscaleConfig(
        enabled=True, kind="ray", min_engines=2, max_engines=2, interval_seconds=0.01
    )
    scaler = Autoscaler(manager, config)
    scaler.start()
    loop = asyncio.get_running_loop()
    added = loop.create_future()

    async def wait_added() -> None:
        while "1" not in manager.handles:
            await asyncio.sleep(0.01)
        added.set_result(None)

    waiter = loop.create_task(wait_added())
    stall = await asyncio.wait_for(longest_stall(added), 10)
    await waiter
    scaler.stop()
    assert manager.pool["1"].origin == "autoscale" and manager.handles["1"].kind == "ray"
    assert threading.get_ident() not in fake_ray.threads and fake_ray.joined
    assert stall < JOIN_SECONDS / 2, f"the loop stalled {stall:.2f} s"
    await manager.stop()


def test_threads_that_join_at_once_start_ray_once(monkeypatch):
    # An HTTP add, a reload and the autoscaler may each join in a thread at the same moment;
    # without the lock each saw Ray not started and called ray.init (a second init fails, or
    # starts a second local instance).
    class SlowRay:
        def __init__(self) -> None:
            self.inits: list[dict] = []

        def is_initialized(self) -> bool:
            return bool(self.inits)

        def init(self, **options) -> None:
            time.sleep(0.2)  # starting Ray: the others arrive meanwhile
            self.inits.append(options)

    ray = SlowRay()
    monkeypatch.setattr(ray_cluster, "import_ray", lambda: ray)
    threads = [threading.Thread(target=ray_cluster.connect, args=("",)) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(ray.inits) == 1


@pytest.mark.parametrize(
    ("address", "entries", "autoscale", "warned"),
    [
        ("auto", (), None, True),  # given, and nothing at start uses it: one line
        ("10.0.0.1:6379", (EngineEntry(kind="local"),), None, True),
        ("", (), None, False),  # not given
        ("auto", (), AutoscaleConfig(enabled=True, kind="ray", max_engines=2), False),
        ("auto", (), AutoscaleConfig(enabled=False, kind="ray", max_engines=2), True),
    ],
)
def test_a_ray_address_without_ray_engines_is_one_warning_not_a_refusal(
    monkeypatch, caplog, address, entries, autoscale, warned
):
    """`--ray-address` with no `kind = "ray"` engine was silently ignored. Refusing it would
    stop a config file shared with daemons that do run Ray engines; the address is still used
    by Ray engines added later (POST /v1/engines, a reload), so the start goes on, saying so."""
    joins = []
    monkeypatch.setattr(ray_cluster, "connect", joins.append)
    with caplog.at_level("WARNING", logger="yaied.router.ray_cluster"):
        ray_cluster.check_start(entries, address, ray_cluster.autoscale_ray(autoscale))
    lines = [r.getMessage() for r in caplog.records]
    assert joins == []  # nothing joins Ray for it at start
    if warned:
        assert len(lines) == 1 and "--ray-address" in lines[0] and address in lines[0], lines
        assert 'no engine is kind = "ray"' in lines[0] and "\n" not in lines[0]
    else:
        assert lines == []


def test_the_start_checks_a_ray_engine_of_the_ranks_its_handle_will_place(monkeypatch):
    """The start-time check asked a node for one rank's bundle whatever
    --tensor-parallel-size said, while the handle places that many ranks: a cluster that could
    hold one rank passed, and the placement failed later, after the socket had opened."""
    checked = []
    monkeypatch.setattr(ray_cluster, "connect", lambda address: SimpleNamespace())
    monkeypatch.setattr(ray_cluster, "check_feasible", lambda ray, e, size: checked.append(size))
    entries = (EngineEntry(kind="ray"), EngineEntry(kind="ray", tensor_parallel_size=4))
    ray_cluster.check_start(entries, "auto", False, default_size=2)
    assert checked == [2, 4]
