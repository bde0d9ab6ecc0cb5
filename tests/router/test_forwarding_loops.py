"""A remote engine that is the daemon itself, or two daemons that list each other, must not pass
calls round until their connections run out: the own address is refused when the config loads,
the own instance id (X-Yaied-Instance) when the engine is added or probed, and a call that comes
back to a daemon it passed through (X-Yaied-Via) gets 508 and goes elsewhere or fails."""

from __future__ import annotations

import socket
import time

import httpx
import orjson
import pytest

from tests.server.conftest import start_server, stop_server
from tests.server.test_engines_http import fake_manager
from yaied.core.forwarding import INSTANCE_HEADER, VIA_HEADER, is_own_address, parse_via
from yaied.core.model_info import ModelInfo
from yaied.core.request import FinishReason, SamplingParams
from yaied.router.config import EngineEntry, RouterConfig
from yaied.router.handle import Health
from yaied.router.remote import RemoteHandle
from yaied.server.config import ServerConfig
from yaied.server.reload import config_reader

pytestmark = pytest.mark.timeout(60)
KEYS = ("admin-secret name=ops admin=true",)
ADMIN = {"Authorization": "Bearer admin-secret"}


def wait_for(predicate, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


@pytest.mark.parametrize(
    ("url", "host", "port", "own"),
    [
        ("http://127.0.0.1:8000", "127.0.0.1", 8000, True),
        ("http://localhost:8000/", "127.0.0.1", 8000, True),
        ("http://127.0.0.2:8000", "0.0.0.0", 8000, True),
        ("http://[::1]:8000", "::", 8000, True),
        ("http://[::1]:8000", "", 8000, True),
        # another loopback address, or the other family: maybe another daemon's (the id tells)
        ("http://127.0.0.2:8000", "127.0.0.1", 8000, False),
        ("http://[::1]:8000", "0.0.0.0", 8000, False),
        ("http://127.0.0.2:8000", "::", 8000, False),
        ("http://[::1]:8000", "127.0.0.1", 8000, False),
        ("http://0.0.0.0:8000", "127.0.0.1", 8000, True),
        ("http://10.0.0.2:8000", "10.0.0.2", 8000, True),
        ("http://127.0.0.1", "127.0.0.1", 80, True),
        ("http://127.0.0.1:8001", "127.0.0.1", 8000, False),
        ("http://10.0.0.3:8000", "0.0.0.0", 8000, False),  # another machine (or this one: id)
        ("http://127.0.0.1:8000", "10.0.0.2", 8000, False),  # bound elsewhere: not us there
    ],
)
def test_own_address(url, host, port, own):
    assert is_own_address(url, host, port) is own


def test_parse_via():
    assert parse_via(None) == () and parse_via("") == ()
    assert parse_via("a, b,,c ") == ("a", "b", "c")


def test_a_config_that_lists_the_daemon_itself_does_not_load(tmp_path):
    path = tmp_path / "yaied.toml"
    path.write_text(
        '[server]\nport = 8100\n\n[[engines]]\nkind = "remote"\nurl = "http://localhost:8100"\n'
    )
    with pytest.raises(ValueError, match="this daemon's own address") as info:
        config_reader(str(path), {}, {})()
    assert "\n" not in str(info.value)
    # The port flag counts as the file does (`yaied serve --port 8200`).
    path.write_text('[[engines]]\nkind = "remote"\nurl = "http://127.0.0.1:8200"\n')
    with pytest.raises(ValueError, match="own address"):
        config_reader(str(path), {"port": 8200}, {})()
    assert config_reader(str(path), {"port": 8201}, {})().engines[0].url.endswith(":8200")


def test_adding_the_daemon_itself_over_http_is_400():
    live = start_server(ServerConfig(api_keys=KEYS), fake_manager, "tiny")
    try:
        own_id = httpx.get(live.url + "/health").headers[INSTANCE_HEADER]
        assert own_id == httpx.get(live.url + "/v1/nowhere").headers[INSTANCE_HEADER]  # every one
        port = live.url.rsplit(":", 1)[1]
        for url in (live.url, f"http://localhost:{port}"):  # not its configured port: its id
            body = {"kind": "remote", "url": url, "api_key": "admin-secret"}
            answer = httpx.post(live.url + "/v1/engines", json=body, headers=ADMIN)
            assert answer.status_code == 400, answer.text
            error = answer.json()["error"]
            assert "is this daemon itself" in error["message"] and "\n" not in error["message"]
            assert error["type"] == "invalid_request_error" and error["param"] == "url"
        listing = httpx.get(live.url + "/v1/engines", headers=ADMIN).json()["data"]
        assert [e["name"] for e in listing] == ["first"]  # nothing was added
    finally:
        stop_server(live)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_configured_remote_engine_that_is_the_daemon_itself_is_refused():
    """By an alias its address check cannot see (the port the test binds is not the config's):
    the probe reads its own instance id back, and the engine is down for good, saying why."""
    port = _free_port()

    def load():
        manager = fake_manager()
        manager.config = RouterConfig(health_check_interval_seconds=0.1)
        manager.add_engine(EngineEntry(kind="remote", url=f"http://localhost:{port}"), name="me")
        return manager

    live = start_server(ServerConfig(), load, "tiny", port=port)
    try:

        def me() -> dict:
            return next(e for e in httpx.get(live.url + "/v1/engines").json()["data"]
                        if e["name"] == "me")  # fmt: skip

        wait_for(lambda: "error" in me())
        assert me()["state"] == "down" and "is this daemon itself" in me()["error"]
        body = {"prompt": [1, 2], "max_tokens": 2}
        for _ in range(4):  # every call goes to the fake engine, none round the loop
            answer = httpx.post(live.url + "/v1/completions", json=body, timeout=10)
            assert answer.status_code == 200, answer.text
        assert httpx.get(live.url + "/health").status_code == 200
    finally:
        stop_server(live)


def test_a_cycle_between_two_daemons_is_cut_where_it_closes():
    a = start_server(ServerConfig(api_keys=KEYS), fake_manager, "tiny")
    b = start_server(ServerConfig(api_keys=KEYS), fake_manager, "tiny")
    try:
        for here, there, name in ((a, b, "to-b"), (b, a, "to-a")):
            body = {"kind": "remote", "url": there.url, "api_key": "admin-secret", "name": name}
            added = httpx.post(here.url + "/v1/engines", json=body, headers=ADMIN)
            assert added.status_code == 202, added.text

        def state(live, name: str) -> str:
            listing = httpx.get(live.url + "/v1/engines", headers=ADMIN).json()["data"]
            return next(e["state"] for e in listing if e["name"] == name)

        wait_for(lambda: state(a, "to-b") == state(b, "to-a") == "up")
        for live in (a, b):  # each now routes only to the other
            drained = httpx.post(live.url + "/v1/engines/first/drain", headers=ADMIN)
            assert drained.status_code == 200, drained.text
        body = {"prompt": [1, 2], "max_tokens": 2}
        started = time.monotonic()
        answer = httpx.post(a.url + "/v1/completions", json=body, headers=ADMIN, timeout=20)
        assert time.monotonic() - started < 10
        assert answer.status_code == 500, answer.text
        message = answer.json()["error"]["message"]
        assert "forwarding loop" in message and "\n" not in message
        # The loop was the call's, not the engines': every remote engine is still up, and each
        # daemon still answers its probes.
        assert state(a, "to-b") == state(b, "to-a") == "up"
        for live in (a, b):
            assert httpx.get(live.url + "/health").status_code == 200
            metrics = httpx.get(live.url + "/metrics", headers=ADMIN).text
            assert 'yaied:engines{model_name="tiny",state="up"} 1.0' in metrics
    finally:
        stop_server(a)
        stop_server(b)


async def test_the_remote_handle_sends_the_hops_and_a_loop_refusal_is_no_failure():
    seen: list[str] = []
    loop_error = {"error": {"message": "forwarding loop: ...", "code": "forwarding_loop"}}

    def daemon(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200, headers={INSTANCE_HEADER: "remote-id"})
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m", "max_model_len": 512}]})
        if request.url.path == "/metrics":
            return httpx.Response(200, text="")
        seen.append(request.headers[VIA_HEADER])
        return httpx.Response(508, content=orjson.dumps(loop_error))

    entry = EngineEntry(kind="remote", url="http://remote:8000")
    handle = RemoteHandle(
        "1", entry, RouterConfig(), instance_id="own-id", transport=httpx.MockTransport(daemon)
    )
    await handle.start()
    assert handle.health is Health.UP
    lost: list[str] = []
    from yaied.router.handle import CallSink

    for i in range(5):  # more than failure_threshold: still no failure of the remote's
        done = []
        sink = CallSink(done.append, lost.append)
        handle.submit(f"r{i}", [1], SamplingParams(), session_id=None, priority=0, sink=sink,
                      via=("first-id",))  # fmt: skip
        wait = time.monotonic() + 5
        while len(lost) <= i and not done:
            assert time.monotonic() < wait
            import asyncio

            await asyncio.sleep(0.01)
        assert not done or done[-1].finish_reason is not FinishReason.STOP
    assert seen == ["first-id,own-id"] * 5
    assert all("forwarding loop" in reason for reason in lost) and len(lost) == 5
    assert handle.health is Health.UP and handle.breaker.failures == 0
    await handle.stop()


async def test_a_probe_that_answers_with_the_own_id_refuses_the_engine():
    def daemon(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, headers={INSTANCE_HEADER: "own-id"})  # still loading

    handle = RemoteHandle(
        "1",
        EngineEntry(kind="remote", url="http://me:8000"),
        RouterConfig(),
        instance_id="own-id",
        transport=httpx.MockTransport(daemon),
    )
    handle.info = ModelInfo(512, 256)
    await handle.start()
    assert handle.health is Health.DOWN
    assert "is this daemon itself" in handle.describe()["error"]
    assert handle._prober is None or handle._prober.done()  # never probed again
    await handle.stop()
