"""An engine process that is alive but silent (SIGSTOP, a wedged interpreter) is lost like a dead
one: past router.remote_read_timeout_seconds without a word (its stats come every 0.2 s) the
router kills it, its calls are told ``lost`` (the manager moves them), and it restarts. Before,
its calls waited for as long as it stayed hung, and GET /v1/engines kept it ``up``. And a start
cancelled while the process starts leaves no process behind."""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
import time

import pytest

from yaied.core.config import load_config
from yaied.core.model_info import ModelInfo
from yaied.core.request import SamplingParams
from yaied.router import local_process
from yaied.router.config import EngineEntry, RouterConfig
from yaied.router.handle import CallSink, Health
from yaied.router.local_process import LocalProcessHandle

pytestmark = pytest.mark.timeout(60)


def silent_child_main(spec, submit_conn, abort_conn, event_conn) -> None:
    """An engine process that says it is ready, then never says anything again (hung)."""
    event_conn.send(("ready", ModelInfo(512, 256)))
    time.sleep(120)


def loading_child_main(spec, submit_conn, abort_conn, event_conn) -> None:
    """An engine process still loading its model (a long load: it says nothing yet)."""
    time.sleep(120)


def talking_child_main(spec, submit_conn, abort_conn, event_conn) -> None:
    """An engine process that is ready and then reports its stats, as a serving child does."""
    event_conn.send(("ready", ModelInfo(512, 256)))
    for _ in range(1200):
        event_conn.send(("stats", {"num_requests_running": 0}, []))
        time.sleep(0.05)


def _handle(tiny_model_dirs, read_timeout: float) -> LocalProcessHandle:
    config = load_config(env={}, overrides={"model": str(tiny_model_dirs["llama"])})
    router = RouterConfig(restart_backoff_seconds=60, remote_read_timeout_seconds=read_timeout)
    return LocalProcessHandle("0", EngineEntry(device="cpu", threads=1), config, router)


async def test_a_silent_engine_process_is_killed_and_its_calls_are_lost(
    tiny_model_dirs, monkeypatch
):
    monkeypatch.setattr(local_process, "child_main", silent_child_main)
    handle = _handle(tiny_model_dirs, read_timeout=0.5)
    await handle.start()
    pid = handle.pid
    lost: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    sink = CallSink(lambda event: None, lost.set_result)
    handle.submit(
        "call-1", [1, 2], SamplingParams(max_tokens=4), session_id=None, priority=0, sink=sink
    )
    try:
        reason = await asyncio.wait_for(lost, 30)
        assert "killed by signal 9 (SIGKILL)" in reason, reason
        assert handle.health is Health.DOWN
        assert "silent for" in handle.describe()["last_exit"]
        assert handle.process is not None and not handle.process.is_alive()
        assert handle.pid == pid  # the restart waits its backoff (60 s)
    finally:
        await handle.stop(2.0)


async def test_an_engine_process_that_reports_is_left_alone(tiny_model_dirs, monkeypatch):
    monkeypatch.setattr(local_process, "child_main", talking_child_main)
    handle = _handle(tiny_model_dirs, read_timeout=2.0)
    await handle.start()
    try:
        await asyncio.sleep(5.0)  # past two read timeouts, each covered by 40 stats
        assert handle.health is Health.UP
        assert handle.process is not None and handle.process.is_alive()
    finally:
        await handle.stop(2.0)


@pytest.mark.parametrize("cancels", [1, 2])  # a removal, then the daemon's stop
async def test_a_start_cancelled_while_the_process_starts_leaves_no_process(
    tiny_model_dirs, monkeypatch, cancels
):
    # A removal (DELETE /v1/engines/ID of an engine still starting) or the daemon's stop cancels
    # the start while a thread is inside Process.start: the process started anyway, unknown to
    # the handle, and went on loading a model (memory, cores, a GPU's memory) unwatched.
    monkeypatch.setattr(local_process, "child_main", loading_child_main)
    started: list[object] = []
    in_start, go_on, done = threading.Event(), threading.Event(), threading.Event()
    real_start = multiprocessing.process.BaseProcess.start

    def held_start(process) -> None:
        in_start.set()
        go_on.wait(30)
        try:
            real_start(process)
            started.append(process)
        finally:
            done.set()

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", held_start)
    handle = _handle(tiny_model_dirs, read_timeout=45.0)
    task = asyncio.get_running_loop().create_task(handle.start())
    assert await asyncio.to_thread(in_start.wait, 30)
    for _ in range(cancels):
        task.cancel()
        await asyncio.sleep(0)  # the cancel lands while the thread is still in Process.start
    go_on.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    await handle.stop(2.0)
    assert await asyncio.to_thread(done.wait, 30)
    assert len(started) == 1
    process = started[0]
    try:
        assert not process.is_alive()
    finally:
        process.kill()
