"""`yaied serve` runs the HTTP daemon: it listens, loads the model, answers, and exits 0 when
stopped by SIGINT or SIGTERM."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM])
def test_yaied_serve_answers_and_exits_0_on_signals(tiny_model_dirs, stop_signal):
    port = free_port()
    argv = [
        "serve",
        "--model",
        str(tiny_model_dirs["llama"]),
        "--port",
        str(port),
        "--kv-cache-gib",
        "0.01",
        "--threads",
        "1",
        "--served-model-name",
        "tiny",
    ]
    code = f"from yaied.cli import main; raise SystemExit(main({argv!r}))"
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the daemon never became healthy"
            time.sleep(0.2)
        response = httpx.post(
            f"{base}/v1/completions",
            json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0},
            timeout=30,
        )
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 3
    finally:
        proc.send_signal(stop_signal)
        try:
            assert proc.wait(timeout=30) == 0
        finally:
            proc.kill()
