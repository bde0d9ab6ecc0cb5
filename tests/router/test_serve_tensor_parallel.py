"""`yaied serve --tensor-parallel-size 2`: a daemon whose engine process runs two ranks answers
the OpenAI API; killing a rank turns the call in flight into an error and the router restarts
the engine; after the daemon stops, no rank process is left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.test_daemon import free_port, serve_command, wait_healthy
from tests.worker.test_tensor_parallel_faults import alive


def spawned_children(pid: int) -> list[int]:
    """multiprocessing-spawned children of ``pid`` (the ranks of an engine process), without
    multiprocessing's resource tracker."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            found.append(int(entry.name))
    return found


def engine_status(base: str) -> dict:
    return httpx.get(f"{base}/v1/engines", timeout=5).json()["data"][0]


@pytest.mark.slow  # a daemon, an engine process and its rank, started twice
@pytest.mark.timeout(300)
def test_serve_tensor_parallel_answers_and_restarts_after_a_rank_dies(tiny_model_dirs, tmp_path):
    config = tmp_path / "yaied.toml"
    config.write_text('[[engines]]\nkind = "local"\ndevice = "cpu"\n')  # behind the router
    port = free_port()
    code = serve_command(
        tiny_model_dirs["llama"], port, "--tensor-parallel-size", "2", "--config", str(config)
    )
    log_path = tmp_path / "daemon.log"
    base = f"http://127.0.0.1:{port}"
    ranks: list[int] = []
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", code], stderr=log)
        try:
            wait_healthy(proc, base, log_path, timeout=150)
            body = {"prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0}
            response = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == 3
            first = engine_status(base)
            assert first["tensor_parallel_size"] == 2
            ranks = spawned_children(first["pid"])
            assert len(ranks) == 1

            # A long call (the tiny model has no tokenizer: its text, and so its stream, stays
            # empty until the end); the rank dies once the engine runs it.
            replies: list[httpx.Response] = []
            long_body = body | {"max_tokens": 900, "ignore_eos": True}
            url = f"{base}/v1/completions"
            reader = threading.Thread(
                target=lambda: replies.append(httpx.post(url, json=long_body, timeout=120))
            )
            reader.start()
            deadline = time.monotonic() + 30
            while not (engine_status(base)["stats"] or {}).get("num_requests_running"):
                assert time.monotonic() < deadline
                time.sleep(0.05)
            os.kill(ranks[0], signal.SIGKILL)
            reader.join(60)
            assert replies and replies[0].status_code >= 500, replies
            assert "tensor-parallel" in replies[0].text or "engine" in replies[0].text

            deadline = time.monotonic() + 120
            while True:  # the router restarts the engine process, ranks and all
                status = engine_status(base)
                if status["health"] == "up" and status["restarts"] == 1:
                    break
                assert time.monotonic() < deadline, status
                time.sleep(0.5)
            assert status["pid"] != first["pid"]
            ranks += spawned_children(status["pid"])
            assert len(ranks) == 2
            response = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
            assert response.status_code == 200, response.text
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                assert proc.wait(timeout=60) == 0, log_path.read_text()
            finally:
                proc.kill()
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in ranks)
