"""What a remote daemon says about a failed call reaches the router's client as the remote said
it, behind the one prefix the router's own server adds."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import orjson
import pytest

from tests.router.fake_remote import ERROR_MESSAGE, HUGE_BYTES, FakeRemote, gzip_bomb
from tests.server.conftest import LiveServer, start_server, stop_server
from yaied.core.model_info import ModelInfo
from yaied.core.request import FinishReason, SamplingParams
from yaied.engine.inputs import InputProcessor
from yaied.router import remote
from yaied.router.config import EngineEntry, RouterConfig
from yaied.router.handle import Health
from yaied.router.manager import EngineManager
from yaied.router.remote import RemoteHandle
from yaied.server.config import ServerConfig

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[2]


def fake_remote(mode: str) -> tuple[subprocess.Popen, str]:
    """tests/router/fake_remote.py in a process of its own (the router's server runs its own
    event loop in a thread); returns the process and its URL."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.router.fake_remote", mode],
        stdout=subprocess.PIPE,
        cwd=ROOT,
        text=True,
    )
    return proc, proc.stdout.readline().strip()


def router_of(*urls: str) -> LiveServer:
    """A router daemon whose engines are the remotes at ``urls`` (ids in, ids out)."""

    def load() -> EngineManager:
        manager = EngineManager(RouterConfig(health_check_interval_seconds=0.2))
        for url in urls:
            manager.add_engine(EngineEntry(kind="remote", url=url))
        hf_config = SimpleNamespace(eos_token_id=None)
        manager.inputs = InputProcessor(None, hf_config, ModelInfo(512, 256))
        return manager

    return start_server(ServerConfig(), load, "tiny")


@pytest.fixture
def failing_remote() -> Iterator[LiveServer]:
    proc, url = fake_remote("error")
    router = router_of(url)
    try:
        yield router
    finally:
        stop_server(router)
        proc.kill()
        proc.wait()


def test_a_remote_engines_error_reaches_the_client_with_one_prefix(failing_remote):
    expected = f"generation failed: {ERROR_MESSAGE}"
    body = {"prompt": [1, 2], "max_tokens": 4}
    answer = httpx.post(failing_remote.url + "/v1/completions", json=body, timeout=20)
    assert answer.status_code == 500, answer.text
    assert answer.json()["error"]["message"] == expected
    with httpx.stream(
        "POST", failing_remote.url + "/v1/completions", json={**body, "stream": True}, timeout=20
    ) as stream:
        chunks = [orjson.loads(line[6:]) for line in stream.iter_lines() if line[6:7] == "{"]
    errors = [chunk["error"] for chunk in chunks if "error" in chunk]
    assert [error["message"] for error in errors] == [expected]


async def test_a_remote_line_that_never_ends_fails_over_and_marks_the_remote_down():
    """A line with no newline is read up to a bound (well above any real event), not without
    one: each call on that remote moves to the other after the token it sent, and the remote,
    which no daemon would be, goes down at once."""
    async with FakeRemote("endless") as bad, FakeRemote("ok") as good:
        manager = await two_remotes(bad, good, health_check_interval_seconds=60)
        params = SamplingParams(max_tokens=8, temperature=0)
        handles = [
            await manager.submit_request(prompt=[1, 2], sampling_params=params) for _ in range(6)
        ]
        outputs = await asyncio.wait_for(asyncio.gather(*(h.result() for h in handles)), 20)
        assert [o.finish_reason for o in outputs] == [FinishReason.STOP] * 6
        assert all(o.token_ids in ([5], [5, 5]) for o in outputs)  # moved: one token each
        assert 1 <= manager.migrations["moved"] == len(bad.headers)
        assert manager.handles["0"].health is Health.DOWN
        assert manager.migrations["failed"] == 0 and not manager._calls
        await manager.stop()


async def two_remotes(bad: FakeRemote, good: FakeRemote, **router: object) -> EngineManager:
    config = RouterConfig(**{"remote_read_timeout_seconds": 5.0, **router})
    manager = EngineManager(config)
    for i, url in enumerate((bad.url, good.url)):
        manager.add_engine(RemoteHandle(str(i), EngineEntry(kind="remote", url=url), config))
    hf_config = SimpleNamespace(eos_token_id=None)
    manager.inputs = InputProcessor(None, hf_config, ModelInfo(512, 256))
    await manager.start()
    return manager


async def test_an_error_body_past_the_bound_fails_over_and_marks_the_remote_down(caplog):
    """A 4xx is the call's own fault, its message the remote's; but one whose body runs to
    megabytes is no daemon's answer: it is read up to a bound, not whole, and the call moves to
    the other remote as for any broken answer."""
    async with FakeRemote("huge_error") as bad, FakeRemote("ok") as good:
        manager = await two_remotes(bad, good, health_check_interval_seconds=60)
        params = SamplingParams(max_tokens=8, temperature=0)
        handles = [
            await manager.submit_request(prompt=[1, 2], sampling_params=params) for _ in range(4)
        ]
        outputs = await asyncio.wait_for(asyncio.gather(*(h.result() for h in handles)), 20)
        assert [(o.finish_reason, o.error) for o in outputs] == [(FinishReason.STOP, None)] * 4
        assert 1 <= manager.migrations["moved"] == len(bad.headers)
        assert manager.handles["0"].health is Health.DOWN
        own = [r.getMessage() for r in caplog.records if r.name == "yaied.router.remote"]
        lines = [line for line in own if "error body" in line]  # each moved call logs its own
        assert len(lines) == 1 and lines[0].startswith("remote engine 0"), lines
        await manager.stop()


@pytest.mark.parametrize(("mode", "what"), [("huge_models", "models"), ("huge_metrics", "metrics")])
async def test_a_probe_body_past_the_bound_is_a_failed_probe_said_once(mode, what, caplog):
    """/v1/models and /metrics are read up to a bound far above any daemon's: a remote whose
    answer runs past it stays down (one log line, the reason in GET /v1/engines), its calls go
    to the other."""
    async with FakeRemote(mode) as bad, FakeRemote("ok") as good:
        manager = await two_remotes(bad, good, health_check_interval_seconds=0.05)
        handle = manager.handles["0"]
        for _ in range(500):
            if bad.probes >= 4:
                break
            await asyncio.sleep(0.01)
        assert bad.probes >= 4 and handle.health is Health.DOWN
        lines = [r.getMessage() for r in caplog.records if r.name == "yaied.router.remote"]
        assert len(lines) == 1 and f"/{what} body of over" in lines[0], lines
        assert "bytes" in handle.describe()["error"]
        params = SamplingParams(max_tokens=8, temperature=0)
        call = await manager.submit_request(prompt=[1, 2], sampling_params=params)
        assert (await asyncio.wait_for(call.result(), 10)).finish_reason is FinishReason.STOP
        assert not bad.headers
        await manager.stop()


@pytest.mark.parametrize("mode", ["gzip_metrics", "gzip_stream"])
async def test_a_gzip_bomb_is_bounded_by_what_it_expands_to(mode, monkeypatch, caplog):
    """httpx decompressed each chunk whole before a bound saw it: a few kilobytes of gzip from a
    remote (a probe's body, a line of the stream) became HUGE_BYTES in the router's memory at
    once. The router asks remotes for identity; one that compresses anyway is decompressed in
    pieces, so its bounds hold on what it expands to: the remote is down, its calls move."""
    monkeypatch.setattr(remote, "MAX_PROBE_BYTES", 1 << 20)  # the stream's lines: 1 MiB too
    gzip_bomb("metrics"), gzip_bomb("stream")  # the fake's own bytes, before the count starts
    tracemalloc.start()
    try:
        async with FakeRemote(mode) as bad, FakeRemote("ok") as good:
            manager = await two_remotes(bad, good, health_check_interval_seconds=0.05)
            params = SamplingParams(max_tokens=8, temperature=0)
            calls = [await manager.submit_request(prompt=[1, 2], sampling_params=params)]
            output = await asyncio.wait_for(calls[0].result(), 20)
            for _ in range(500):
                if manager.handles["0"].health is Health.DOWN:
                    break
                await asyncio.sleep(0.01)
            peak, health = tracemalloc.get_traced_memory()[1], manager.handles["0"].health
            await manager.stop()
    finally:
        tracemalloc.stop()
    assert output.finish_reason is FinishReason.STOP and health is Health.DOWN
    assert peak < HUGE_BYTES // 4, f"{peak} bytes held at once"
    assert all(h["accept-encoding"] == "identity" for h in bad.headers + good.headers)
    lines = [r.getMessage() for r in caplog.records if r.name == "yaied.router.remote"]
    assert any("bytes" in line for line in lines), lines
