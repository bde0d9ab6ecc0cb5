"""SIGTERM, sent as systemd sends it (to every process of the service), ends `yaied serve` within
``server.stop_timeout_seconds`` in every mode: one engine with streams that would outlast the
drain, a router with an engine process, and a model still converting. The unit's TimeoutStopSec
leaves shutdown.EXIT_SECONDS beyond the default stop timeout for the process's own exit."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import orjson
import pytest

from tests.test_daemon import free_port, serve_command, wait_healthy
from tests.test_systemd_unit import read_unit
from tests.worker.test_model_files import _write_tiny_gguf
from yaied.server.config import ServerConfig
from yaied.server.shutdown import EXIT_SECONDS, StopClock
from yaied.worker import model_cache

ROOT = Path(__file__).resolve().parents[1]
STOP_TIMEOUT = 6.0
EXIT_SLACK = 3.0  # interpreter and torch teardown on a busy machine

# Loaded first by every Python process started with it on PYTHONPATH (engine processes too):
# YAIED_TEST_SLOW="module:Class.function:seconds" makes that function sleep first.
SITECUSTOMIZE = """
import importlib.abc, importlib.machinery, os, sys, time

class _Slow(importlib.abc.MetaPathFinder):
    def __init__(self, module, attribute, seconds):
        self.module, self.attribute, self.seconds = module, attribute, seconds

    def find_spec(self, name, path, target=None):
        if name != self.module:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            *owner_path, name = self.attribute.split(".")
            owner = module
            for part in owner_path:
                owner = getattr(owner, part)
            original = getattr(owner, name)

            def slow(*args, **kwargs):
                time.sleep(self.seconds)
                return original(*args, **kwargs)

            setattr(owner, name, slow)

        spec.loader.exec_module = exec_module
        return spec

if os.environ.get("YAIED_TEST_SLOW"):
    module, attribute, seconds = os.environ["YAIED_TEST_SLOW"].split(":")
    sys.meta_path.insert(0, _Slow(module, attribute, float(seconds)))
"""


def test_the_default_stop_fits_the_units_stop_timeout():
    stop_timeout = ServerConfig().stop_timeout_seconds
    assert stop_timeout + EXIT_SECONDS <= int(read_unit()["Service"]["TimeoutStopSec"])
    clock = StopClock(stop_timeout)
    assert clock.drain_seconds(ServerConfig().drain_timeout_seconds) >= 29  # all of the drain


def start_daemon(tmp_path: Path, code: str, slow: str, **env: str) -> subprocess.Popen:
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), str(ROOT)]),
        YAIED_TEST_SLOW=slow,
        YAIED_SERVER_STOP_TIMEOUT_SECONDS=str(STOP_TIMEOUT),
        YAIED_CACHE_DIR=str(tmp_path / "cache"),
        **env,
    )
    log = open(tmp_path / "daemon.log", "w")  # noqa: SIM115  (the process keeps writing to it)
    # A session of its own: SIGTERM goes to the group, as systemd signals the whole service.
    return subprocess.Popen(
        [sys.executable, "-c", code], stderr=log, env=env, start_new_session=True
    )


def stop_and_time(proc: subprocess.Popen, log_path: Path) -> float:
    started = time.monotonic()
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        code = proc.wait(timeout=STOP_TIMEOUT + EXIT_SECONDS)
    finally:
        with_group_killed(proc)
    assert code == 0, log_path.read_text()
    return time.monotonic() - started


def with_group_killed(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # engine processes left behind, if any
    proc.wait()


def long_stream(base: str) -> list[dict]:
    body = {
        "prompt": [1, 2, 3],
        "max_tokens": 900,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    response = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    return [orjson.loads(e) for e in events if e != "[DONE]"]


def assert_stops_in_time_with_a_stream_open(proc, base: str, log_path: Path) -> None:
    """A stream of 900 tokens at 20 ms a step would take 18 s: past the stop's budget."""
    try:
        wait_healthy(proc, base, log_path, timeout=120)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            stream = pool.submit(long_stream, base)
            time.sleep(1.0)  # streaming now
            seconds = stop_and_time(proc, log_path)
            chunks = stream.result(timeout=10)
    finally:
        with_group_killed(proc)
    assert seconds < STOP_TIMEOUT + EXIT_SLACK, log_path.read_text()
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort"  # ended, not cut off


def test_sigterm_stops_a_single_engine_daemon_in_time(tiny_model_dirs, tmp_path):
    port = free_port()
    code = serve_command(tiny_model_dirs["llama"], port)
    proc = start_daemon(tmp_path, code, "yaied.worker.worker:Worker.execute:0.02")
    assert_stops_in_time_with_a_stream_open(
        proc, f"http://127.0.0.1:{port}", tmp_path / "daemon.log"
    )


@pytest.mark.slow  # two processes load torch
def test_sigterm_stops_a_router_and_its_engine_process_in_time(tiny_model_dirs, tmp_path):
    config = tmp_path / "yaied.toml"
    config.write_text('[[engines]]\nkind = "local"\ndevice = "cpu"\nthreads = 1\n')
    port = free_port()
    code = serve_command(tiny_model_dirs["llama"], port, "--config", str(config))
    proc = start_daemon(tmp_path, code, "yaied.worker.worker:Worker.execute:0.02")
    assert_stops_in_time_with_a_stream_open(
        proc, f"http://127.0.0.1:{port}", tmp_path / "daemon.log"
    )


def test_sigterm_during_a_model_conversion_exits_in_time(tmp_path):
    """The conversion cannot be interrupted: the daemon gives up waiting for it, and its
    temporary folder goes at the next start (its lock died with the process)."""
    gguf = tmp_path / "tiny.gguf"
    _write_tiny_gguf(gguf)
    port = free_port()
    proc = start_daemon(
        tmp_path, serve_command(gguf, port), "yaied.worker.gguf_convert:_write_safetensors:300"
    )
    cache = tmp_path / "cache"
    try:
        deadline = time.monotonic() + 60
        while not (cache.is_dir() and any(p.name.startswith(".tiny-") for p in cache.iterdir())):
            assert proc.poll() is None and time.monotonic() < deadline, "no conversion started"
            time.sleep(0.1)
        seconds = stop_and_time(proc, tmp_path / "daemon.log")
    finally:
        with_group_killed(proc)
    assert seconds < STOP_TIMEOUT + EXIT_SLACK
    [temporary] = [p for p in cache.iterdir() if p.is_dir() and p.name.startswith(".tiny-")]
    assert model_cache.remove_stale_temporaries(cache) == [temporary]
