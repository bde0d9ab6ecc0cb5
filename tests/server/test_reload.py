"""A reload (server/reload.py) over a manager of fake engines: what it logs and keeps when the
config's new engines cannot be applied. The daemon's SIGHUP path: tests/test_reload.py."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from tests.router.test_manager import FakeEngine
from yaied.core.config import load_config
from yaied.core.host_memory import GIB
from yaied.core.model_info import ModelInfo
from yaied.engine.inputs import InputProcessor
from yaied.router.autoscale import AutoscaleConfig
from yaied.router.config import EngineEntry, RouterConfig
from yaied.router.manager import EngineManager
from yaied.router.room import HostRoom
from yaied.server.config import ServerConfig
from yaied.server.keys import KeyTable
from yaied.server.reload import DaemonConfig, reload

pytestmark = pytest.mark.timeout(30)


async def _serving_engine_a(monkeypatch) -> EngineManager:
    """A manager serving one fake CPU engine "a", with a 2 GiB KV pool an engine."""
    config = load_config(env={}, overrides={"device.device": "cpu", "cache.kv_cache_gib": 2.0})
    manager = EngineManager(RouterConfig(), engine_config=config)
    monkeypatch.setattr(manager, "_build_handle", lambda engine_id, entry: FakeEngine(engine_id))
    manager.add_engine(EngineEntry(device="cpu", name="a"))
    manager.inputs = InputProcessor(None, SimpleNamespace(eos_token_id=None), ModelInfo(64, 8))
    await manager.start()
    return manager


async def test_new_cpu_engines_past_the_memory_left_leave_the_pool_but_the_keys_apply(
    monkeypatch, caplog
):
    manager = await _serving_engine_a(monkeypatch)
    # 1 GiB of weights + a 2 GiB KV pool + 256 MiB a process at the least, in 3 GiB
    manager.room = HostRoom(GIB, available=lambda: 3 * GIB, cores=lambda: 8)
    server = SimpleNamespace(
        manager=manager, draining=False, keys=KeyTable.parse(["old"]), config=ServerConfig()
    )
    entries = (EngineEntry(device="cpu", name="a"), EngineEntry(device="cpu", name="b"))

    def read() -> DaemonConfig:
        return DaemonConfig(
            ServerConfig(api_keys=("new",)), RouterConfig(), entries, AutoscaleConfig()
        )

    with caplog.at_level(logging.INFO, logger="yaied"):
        assert await reload(server, read) is True
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, caplog.text
    message = errors[0].getMessage()
    expected = "reload: 1 API keys (0 admin) applied; engines unchanged: [[engines]] added by"
    assert message.startswith(expected), message
    assert "need ~3.2 GiB" in message and "the 3.0 GiB" in message
    assert [e.name for e in manager.pool.values()] == ["a"] and manager.engine_state("0") == "up"
    # a key revoked does not wait on an engine that cannot start
    assert server.keys.lookup(b"old") is None and server.keys.lookup(b"new") is not None
    await manager.stop()


async def test_a_reload_whose_cpu_engines_do_not_fit_starts_or_joins_no_ray(monkeypatch, caplog):
    """A reload adding a ray engine and a CPU engine past the memory left started or joined
    Ray (seconds, a cluster joined for nothing) before the fit check said nothing changed."""
    pytest.importorskip("ray")  # a ray entry needs Ray installed; none is started here
    from yaied.server import reload as reload_module

    manager = await _serving_engine_a(monkeypatch)
    manager.room = HostRoom(GIB, available=lambda: 3 * GIB, cores=lambda: 8)
    joined = []

    async def join_for(address, entries, size):
        joined.append([e.name for e in entries])

    monkeypatch.setattr(reload_module, "join_for", join_for)
    server = SimpleNamespace(
        manager=manager, draining=False, keys=KeyTable.parse(["old"]), config=ServerConfig()
    )
    entries = (
        EngineEntry(device="cpu", name="a"),
        EngineEntry(kind="ray", name="r"),
        EngineEntry(device="cpu", name="b"),
    )

    def read() -> DaemonConfig:
        return DaemonConfig(
            ServerConfig(api_keys=("old",)), RouterConfig(), entries, AutoscaleConfig()
        )

    with caplog.at_level(logging.INFO, logger="yaied"):
        assert await reload(server, read) is True  # the keys, unchanged here
    assert joined == []
    assert "engines unchanged: [[engines]] added by the reload" in caplog.text
    assert [e.name for e in manager.pool.values()] == ["a"]
    await manager.stop()
