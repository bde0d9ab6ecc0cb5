"""SIGHUP reloads the config: `yaied serve` over three fake remote daemons, reloaded with a config
that removes one engine, adds another and changes the keys; then with a broken file, which
changes nothing. systemd hears RELOADING=1 and READY=1 around each."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.test_daemon import free_port, serve_command, wait_healthy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
ROOT = Path(__file__).resolve().parent.parent


def config(keys: list[str], engines: dict[str, str]) -> str:
    lines = ["[server]", f"api_keys = {keys!r}".replace("'", '"'), "[router]"]
    lines.append("health_check_interval_seconds = 0.5")
    for name, url in engines.items():
        lines += ["[[engines]]", 'kind = "remote"', f'name = "{name}"', f'url = "{url}"']
    return "\n".join(lines) + "\n"


def fake_remote() -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.router.fake_remote", "ok"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    return proc, proc.stdout.readline().strip()


def engines(base: str, key: str) -> dict[str, tuple[str, str]]:
    """Name -> (id, state), the latest engine of each name."""
    headers = {"Authorization": f"Bearer {key}"}
    listing = httpx.get(f"{base}/v1/engines", headers=headers, timeout=5).json()["data"]
    return {e["name"]: (e["id"], e["state"]) for e in sorted(listing, key=lambda e: int(e["id"]))}


def wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.1)


def test_sighup_applies_engines_and_keys_and_a_broken_file_changes_nothing(
    tiny_model_dirs, tmp_path
):
    remotes = [fake_remote() for _ in range(3)]
    urls = dict(zip("abc", (url for _, url in remotes), strict=True))
    path = tmp_path / "yaied.toml"
    path.write_text(config(["old name=ops admin=true"], {"a": urls["a"], "b": urls["b"]}))
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify.sock"))
    notify.settimeout(20)
    env = dict(os.environ, NOTIFY_SOCKET=str(tmp_path / "notify.sock"))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "daemon.log"
    code = serve_command(tiny_model_dirs["llama"], port, "--config", str(path))
    with open(log_path, "w") as log, notify:
        proc = subprocess.Popen([sys.executable, "-c", code], stderr=log, env=env)
        try:
            wait_healthy(proc, base, log_path)
            assert notify.recv(64) == b"READY=1"
            assert engines(base, "old") == {"a": ("0", "up"), "b": ("1", "up")}

            path.write_text(config(["new name=ops admin=true"], {"b": urls["b"], "c": urls["c"]}))
            proc.send_signal(signal.SIGHUP)
            reloading = notify.recv(128).decode()
            assert reloading.startswith("RELOADING=1\nMONOTONIC_USEC=")
            assert notify.recv(64) == b"READY=1"
            wait_for(lambda: engines(base, "new").get("a", ("", ""))[1] == "removed")
            wait_for(lambda: engines(base, "new")["c"][1] == "up")
            assert engines(base, "new") == {
                "a": ("0", "removed"),
                "b": ("1", "up"),
                "c": ("2", "up"),
            }
            old = httpx.get(f"{base}/v1/engines", headers={"Authorization": "Bearer old"})
            assert old.status_code == 401  # the keys were swapped too

            path.write_text("[[engines]\nkind = ")  # not TOML
            proc.send_signal(signal.SIGHUP)
            assert notify.recv(128).decode().startswith("RELOADING=1")
            assert notify.recv(64) == b"READY=1"
            assert engines(base, "new") == {
                "a": ("0", "removed"),
                "b": ("1", "up"),
                "c": ("2", "up"),
            }
            response = httpx.post(
                f"{base}/v1/completions",
                json={"prompt": [1, 2], "max_tokens": 2},
                headers={"Authorization": "Bearer new"},
                timeout=30,
            )
            assert response.status_code == 200, response.text
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                assert proc.wait(timeout=30) == 0, log_path.read_text()
            finally:
                proc.kill()
                for remote, _ in remotes:
                    remote.kill()
                    remote.wait()
    text = log_path.read_text()
    assert "reload failed, nothing changed" in text
    assert "engine 0 (a) removed" in text
