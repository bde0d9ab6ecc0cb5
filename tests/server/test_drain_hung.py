"""A stop (SIGTERM) whose drain times out aborts the calls left; an engine that never confirms
those aborts (a hung engine process) must not leave their streams open until the server cuts
the connections: each ends with finish_reason ``abort``, as the README promises. Before, the
server closed them mid-stream, or sent a non-streaming client an empty body."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest

from tests.router.test_manager import FakeEngine, params
from yaied.core.model_info import ModelInfo
from yaied.core.request import FinishReason
from yaied.engine.inputs import InputProcessor
from yaied.router.config import RouterConfig
from yaied.router.manager import EngineManager
from yaied.server.config import ServerConfig
from yaied.server.state import ServerState

pytestmark = pytest.mark.timeout(30)


class HungEngine(FakeEngine):
    """Takes calls, then sends nothing more, and ignores aborts (SIGSTOPped)."""

    async def abort(self, request_id: str) -> None:
        return None


async def test_a_drain_ends_the_calls_of_an_engine_that_never_answers_its_aborts():
    manager = EngineManager(RouterConfig())
    hung = HungEngine("0", tick=3600.0)  # no token within the test
    manager.add_engine(hung)
    manager.inputs = InputProcessor(None, SimpleNamespace(eos_token_id=None), ModelInfo(8192, 256))
    await manager.start()
    server = ServerState(ServerConfig(), "fake")
    server.manager = manager
    handles = [
        await manager.submit_request(prompt=[1, 2], sampling_params=params(8)) for _ in range(3)
    ]
    await server.drain(0.0, 0.05)
    outputs = await asyncio.wait_for(asyncio.gather(*(h.result() for h in handles)), 10)
    assert [o.finish_reason for o in outputs] == [FinishReason.ABORT] * 3
    assert manager.num_requests_in_flight == 0
    assert manager._outstanding["0"] == {}
    for task in hung.tasks:
        task.cancel()


async def test_a_model_that_loads_after_the_stop_began_is_not_announced(caplog):
    """SIGTERM while the model loads: the stop waits for the load, which then logged "yaied
    ready ... listening" (and told systemd READY=1 after STOPPING=1) for a server that was
    exiting."""
    manager = EngineManager(RouterConfig())
    manager.add_engine(FakeEngine("0"))
    manager.inputs = InputProcessor(None, SimpleNamespace(eos_token_id=None), ModelInfo(8192, 256))
    server = ServerState(ServerConfig(), "fake")
    server.draining = True  # the daemon's SIGTERM handler began the drain
    with caplog.at_level(logging.INFO, logger="yaied.server.state"):
        serving = await server.load(lambda: manager)
    assert not serving  # the app sends READY=1 when it serves
    assert "yaied ready" not in caplog.text
    assert "stopping" in caplog.text
    await manager.stop(5.0)
