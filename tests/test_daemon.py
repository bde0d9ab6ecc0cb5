"""`yaied serve` runs the HTTP daemon: it listens, loads the model, tells systemd READY=1, answers,
and on SIGINT or SIGTERM says STOPPING=1 and exits 0."""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import orjson
import pytest


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, base: str, log_path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, log_path.read_text()
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the daemon never became healthy"
        time.sleep(0.2)


def serve_command(model, port: int, *extra: str) -> str:
    """Python code that runs `yaied serve` on a tiny model, for `python -c`."""
    argv = [
        "serve",
        "--model",
        str(model),
        "--port",
        str(port),
        "--kv-cache-gib",
        "0.01",
        "--threads",
        "1",
        *extra,
    ]
    return f"from yaied.cli import main; raise SystemExit(main({argv!r}))"


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM])
def test_yaied_serve_answers_and_exits_0_on_signals(tiny_model_dirs, tmp_path, stop_signal):
    port = free_port()
    code = serve_command(tiny_model_dirs["llama"], port, "--served-model-name", "tiny")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify.sock"))
    notify.settimeout(30)
    env = dict(os.environ, NOTIFY_SOCKET=str(tmp_path / "notify.sock"))
    log_path = tmp_path / "daemon.log"
    with open(log_path, "w") as log, notify:
        proc = subprocess.Popen([sys.executable, "-c", code], stderr=log, env=env)
        base = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(proc, base, log_path)
            assert notify.recv(64) == b"READY=1"  # sent once the model had loaded
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
                assert proc.wait(timeout=30) == 0, log_path.read_text()
            finally:
                proc.kill()
        assert notify.recv(64) == b"STOPPING=1"
    assert "request cmpl-" in log_path.read_text()  # the per-request log line


def test_sigterm_drains_open_streams_first(tiny_model_dirs, tmp_path):
    port = free_port()
    code = serve_command(tiny_model_dirs["llama"], port)
    log_path = tmp_path / "daemon.log"
    base = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", code], stderr=log)
        try:
            wait_healthy(proc, base, log_path)
            body = {
                "prompt": [1, 2, 3],
                "max_tokens": 1000,
                "ignore_eos": True,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
                "logprobs": 5,
                "n": 8,
            }
            streaming, resume = threading.Event(), threading.Event()

            def read_paused() -> tuple[int, list[str]]:
                # The client stops reading after the first line until health has been seen
                # draining. The drain waits for the engine's call (8 choices of 1000 tokens with
                # five logprobs each, a few seconds); the paused reader fills the socket buffers,
                # so the server's loop waits on them rather than writing, and answers health
                # promptly however loaded the machine.
                with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
                    lines = []
                    for line in r.iter_lines():
                        if not streaming.is_set():
                            streaming.set()
                            resume.wait(30)
                        lines.append(line)
                    return r.status_code, lines

            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                pending = pool.submit(read_paused)
                assert streaming.wait(30)  # the request is running now
                proc.send_signal(signal.SIGTERM)
                statuses = set()
                deadline = time.monotonic() + 20
                while 503 not in statuses and time.monotonic() < deadline:
                    with contextlib.suppress(httpx.TransportError):
                        statuses.add(httpx.get(f"{base}/health", timeout=5).status_code)
                    time.sleep(0.02)
                resume.set()
                status, lines = pending.result()
            assert status == 200, lines
            events = [line[6:] for line in lines if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            chunks = [orjson.loads(e) for e in events[:-1]]
            reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
            assert reasons[-1] == "length"  # the open stream finished, not cut off
            assert chunks[-1]["usage"]["completion_tokens"] == 8 * 1000
            assert 503 in statuses  # draining: health says so while the request runs
            assert proc.wait(timeout=30) == 0, log_path.read_text()
        finally:
            proc.kill()


def test_yaied_serve_exits_non_zero_when_its_engine_dies(tiny_model_dirs, tmp_path):
    """A step that hangs past engine.step_timeout_s kills the one engine: the request gets its
    error, and the daemon exits non-zero at once (for systemd or a shell loop to restart it)
    instead of answering 503 forever."""
    port = free_port()
    hang = (
        "import time\n"
        "from yaied.worker.worker import Worker\n"
        "execute = Worker.execute\n"
        "def hanging(self, batch):\n"
        "    if any(s.token_ids[:1] == [99] for s in batch.seqs):\n"
        "        time.sleep(30)\n"
        "    return execute(self, batch)\n"
        "Worker.execute = hanging\n"
    )
    code = hang + serve_command(tiny_model_dirs["llama"], port, "--served-model-name", "tiny")
    env = dict(os.environ, YAIED_ENGINE_STEP_TIMEOUT_S="0.5")
    log_path = tmp_path / "daemon.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", code], stderr=log, env=env)
        base = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(proc, base, log_path)
            body = {"model": "tiny", "prompt": [1, 2], "max_tokens": 2}
            assert httpx.post(f"{base}/v1/completions", json=body).status_code == 200
            hung = httpx.post(f"{base}/v1/completions", json={**body, "prompt": [99, 2]})
            assert hung.status_code == 500 and "step_timeout_s" in hung.text
            started = time.monotonic()
            assert proc.wait(timeout=20) == 1  # retried by systemd (2 would not be)
            assert time.monotonic() - started < 15  # not after the hung step's 30 s
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert "the engine stopped" in log_path.read_text()


# -- the listening sockets, bound before the model loads ------------------------------------


def _resolves_to(monkeypatch, *addresses: tuple[socket.AddressFamily, str]) -> None:
    def getaddrinfo(host, port, *args, **kwargs):
        return [(family, socket.SOCK_STREAM, 6, "", (ip, port)) for family, ip in addresses]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


def test_a_family_the_kernel_lacks_is_skipped_as_asyncio_skips_it(monkeypatch):
    # `localhost` resolves to ::1 as well on most hosts; with IPv6 switched off the bind of
    # 127.0.0.1 alone served before sockets were bound here, and must still.
    from yaied.daemon import listening_sockets

    _resolves_to(monkeypatch, (socket.AF_INET6, "::1"), (socket.AF_INET, "127.0.0.1"))
    real = socket.socket

    def no_ipv6(family=socket.AF_INET, *args, **kwargs):
        if family == socket.AF_INET6:
            raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")
        return real(family, *args, **kwargs)

    monkeypatch.setattr(socket, "socket", no_ipv6)
    sockets = listening_sockets("localhost", 0)
    try:
        assert [s.getsockname()[0] for s in sockets] == ["127.0.0.1"]
    finally:
        for sock in sockets:
            sock.close()


def test_an_address_not_on_this_machine_is_skipped_while_another_binds(monkeypatch):
    from yaied.daemon import listening_sockets

    _resolves_to(monkeypatch, (socket.AF_INET, "192.0.2.1"), (socket.AF_INET, "127.0.0.1"))
    sockets = listening_sockets("somewhere", 0)
    try:
        assert [s.getsockname()[0] for s in sockets] == ["127.0.0.1"]
    finally:
        for sock in sockets:
            sock.close()
    _resolves_to(monkeypatch, (socket.AF_INET, "192.0.2.1"))  # TEST-NET-1: on no interface
    with pytest.raises(OSError, match=r"cannot listen on elsewhere:0: .*assign"):
        listening_sockets("elsewhere", 0)


async def test_a_sighup_during_a_reload_reads_the_file_once_more_after_it():
    """A SIGHUP while a reload ran (a Ray join takes seconds) was dropped: a key revoked in the
    file meanwhile stayed valid until someone sent another. Now one more reload follows the
    running one, however many SIGHUPs came meanwhile."""
    import asyncio

    import uvicorn

    from yaied.daemon import DrainingServer
    from yaied.server.config import ServerConfig

    server = DrainingServer(uvicorn.Config(app=None), ServerConfig(), read_config=lambda: None)
    server._loop = asyncio.get_running_loop()
    runs, release = [], asyncio.Event()

    async def reload_once() -> None:
        runs.append(len(runs))
        if len(runs) == 1:
            await release.wait()  # the first reload is still running when the SIGHUPs come

    server._reload = reload_once
    server._reload_soon()
    await asyncio.sleep(0)
    server._reload_soon()
    server._reload_soon()
    release.set()
    for _ in range(20):
        await asyncio.sleep(0)
    assert runs == [0, 1]
