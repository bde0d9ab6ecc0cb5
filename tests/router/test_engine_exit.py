"""How an engine process's end is reported: a process killed by a signal is named so ("killed by
signal 9 (SIGKILL)"), never "code None", in the calls' loss reason, the log and GET /v1/engines."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import pytest

from yaied.core.config import load_config
from yaied.core.errors import EngineStartError
from yaied.core.model_info import ModelInfo
from yaied.core.processes import describe_exit
from yaied.core.request import SamplingParams
from yaied.router import local_process
from yaied.router.config import EngineEntry, RouterConfig
from yaied.router.handle import CallSink, Health
from yaied.router.local_process import LocalProcessHandle

pytestmark = pytest.mark.timeout(60)


def test_exit_codes_are_described_in_words():
    assert describe_exit(-signal.SIGKILL) == "killed by signal 9 (SIGKILL)"
    assert describe_exit(-signal.SIGSEGV) == "killed by signal 11 (SIGSEGV)"
    assert describe_exit(0) == "exited with status 0"
    assert describe_exit(3) == "exited with status 3"
    assert describe_exit(-200) == "killed by signal 200"
    assert describe_exit(None) == "exited (status unknown)"


def idle_child_main(spec, submit_conn, abort_conn, event_conn) -> None:
    """An engine process that is ready at once and then takes calls it never answers."""
    event_conn.send(("ready", ModelInfo(512, 256)))
    time.sleep(120)


async def test_a_killed_engine_process_is_reported_by_its_signal(
    tiny_model_dirs, monkeypatch, caplog
):
    monkeypatch.setattr(local_process, "child_main", idle_child_main)
    config = load_config(env={}, overrides={"model": str(tiny_model_dirs["llama"])})
    router = RouterConfig(restart_backoff_seconds=60)  # no restart within the test
    handle = LocalProcessHandle("0", EngineEntry(device="cpu", threads=1), config, router)
    await handle.start()
    lost: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    sink = CallSink(lambda event: None, lost.set_result)
    params = SamplingParams(max_tokens=4)
    handle.submit("call-1", [1, 2], params, session_id=None, priority=0, sink=sink)
    try:
        with caplog.at_level(logging.ERROR, logger="yaied.router.local_process"):
            os.kill(handle.pid, signal.SIGKILL)
            reason = await asyncio.wait_for(lost, 20)
        assert "killed by signal 9 (SIGKILL)" in reason, reason
        assert "None" not in reason
        assert any("killed by signal 9 (SIGKILL)" in r.getMessage() for r in caplog.records)
        assert handle.health is Health.DOWN
        assert handle.describe()["last_exit"] == "killed by signal 9 (SIGKILL)"
    finally:
        await handle.stop(2.0)


def killed_while_loading_main(spec, submit_conn, abort_conn, event_conn) -> None:
    """An engine process killed while it loads (the kernel's OOM killer, an operator)."""
    os.kill(os.getpid(), signal.SIGKILL)


async def test_a_process_killed_while_loading_is_an_engine_start_error(
    tiny_model_dirs, monkeypatch
):
    # The start's failure says how the process ended, as an EngineStartError: the CLI prints
    # it as one line (exit 1); it was a bare RuntimeError, a traceback.
    monkeypatch.setattr(local_process, "child_main", killed_while_loading_main)
    config = load_config(env={}, overrides={"model": str(tiny_model_dirs["llama"])})
    handle = LocalProcessHandle("0", EngineEntry(device="cpu", threads=1), config, RouterConfig())
    try:
        with pytest.raises(EngineStartError, match=r"killed by signal 9 \(SIGKILL\) while loading"):
            await handle.start()
    finally:
        await handle.stop(2.0)


def stopping_child_main(spec, submit_conn, abort_conn, event_conn) -> None:
    """An engine process that serves until the router's stop (None on the submit pipe), then
    exits 0 as the real one does."""
    event_conn.send(("ready", ModelInfo(512, 256)))
    while submit_conn.recv() is not None:
        pass
    event_conn.close()
    os._exit(0)


async def test_a_stopped_engine_process_says_it_exited_0(tiny_model_dirs, monkeypatch):
    # A removed engine's last_exit in GET /v1/engines read None or "exited (status unknown)":
    # stop() and the event reader both reaped the process, and the pool took its status before
    # the reader's report. Only the reader reaps it now, and stop() waits for its report.
    monkeypatch.setattr(local_process, "child_main", stopping_child_main)
    config = load_config(env={}, overrides={"model": str(tiny_model_dirs["llama"])})
    handle = LocalProcessHandle("0", EngineEntry(device="cpu", threads=1), config, RouterConfig())
    await handle.start()
    await handle.stop(10.0)
    assert handle.describe()["last_exit"] == "exited with status 0"
    assert handle.health is Health.STOPPED
