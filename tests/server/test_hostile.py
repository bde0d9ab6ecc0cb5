"""Hostile clients and tenants (issue 19), against a live daemon on a tiny random-weight model:
every request bounded before it costs anything, every wait timed out, no key reaching another's
work, no internal text in an error body."""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import quote, urlsplit

import httpx
import orjson
import pytest

from tests.server.conftest import engine_loader, start_server, stop_server
from tests.waiting import wait_until
from yaied.server.config import ServerConfig

ALICE = {"Authorization": "Bearer sk-alice"}
BOB = {"Authorization": "Bearer sk-bob"}
NON_ASCII_USER = "Jürgen 🚀 ユーザー\r\nX-Injected: 1"
# No tokenizer, so no text: token ids make every token a chunk.
LONG = {"prompt": [1, 2, 3], "max_tokens": 400, "ignore_eos": True, "return_token_ids": True}

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def hostile(tiny_model_dirs):
    config = ServerConfig(
        api_keys=("sk-alice name=alice may_set_priority=true", "sk-bob name=bob max_in_flight=1"),
        served_model_name="tiny",
        body_timeout_seconds=1.0,
        send_timeout_seconds=1.0,
    )
    loader = engine_loader(model=str(tiny_model_dirs["llama"]), max_model_len=0, threads=1)
    server = start_server(config, loader, "ignored")
    # A step takes at least 3 ms, so that a 1,000-token stream runs for seconds: long enough to
    # cancel it, to refuse a request beside it, to stop reading it.
    server.server.config.app.state.server.engine.worker.fault_hook = slow_step
    yield server
    stop_server(server)


def slow_step(batch) -> None:
    time.sleep(0.003)


def manager_of(live):
    return live.server.config.app.state.server.manager


def wait_in_flight(live, count: int = 1) -> None:
    """Until the router holds `count` requests: a stream started in a thread is under way."""
    wait_until(
        lambda: manager_of(live).num_requests_in_flight >= count,
        timeout=20,
        what=f"{count} requests in flight",
    )


def wait_idle(live, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while manager_of(live).num_requests_in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert manager_of(live).num_requests_in_flight == 0


def stream_times(url: str, body: dict, headers: dict) -> tuple[list[float], str | None]:
    """Arrival times of a stream's chunks, and its finish reason."""
    times, finish = [], None
    with httpx.stream("POST", url, json={**body, "stream": True}, headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                times.append(time.monotonic())
                finish = orjson.loads(line[6:])["choices"][0]["finish_reason"] or finish
    return times, finish


def test_amplification_body_is_refused_at_once_while_a_stream_flows(hostile):
    url = hostile.v1 + "/completions"
    with ThreadPoolExecutor(1) as pool:
        flowing = pool.submit(stream_times, url, LONG, ALICE)
        wait_in_flight(hostile)
        amplified = {"prompt": [[1, 2, 3]] * 5000, "n": 128, "max_tokens": 16}
        start = time.monotonic()
        r = httpx.post(url, json=amplified, headers=ALICE, timeout=30)
        elapsed = time.monotonic() - start
        assert r.status_code == 400 and elapsed < 1.0, (r.status_code, elapsed)
        assert r.json()["error"]["code"] == "too_many_completions"
        r = httpx.post(url, json={**amplified, "n": 1}, headers=ALICE, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        refused_at = time.monotonic()
        times, finish = flowing.result()
    assert finish == "length" and times[-1] > refused_at  # it flowed all along
    assert max(b - a for a, b in zip(times, times[1:], strict=False)) < 1.0  # never stalled


def test_oversized_ids_get_400(hostile):
    url = hostile.v1 + "/completions"
    body = {"prompt": [1], "max_tokens": 1}
    huge = "s" * (1 << 20)
    r = httpx.post(url, json={**body, "user": huge}, headers=ALICE)
    assert r.status_code == 400 and r.json()["error"]["param"] == "user"
    for header in ("X-Session-Id", "X-Request-Id"):
        r = httpx.post(url, json=body, headers={**ALICE, header: "s" * 257})
        assert r.status_code == 400 and header in r.json()["error"]["message"]
        try:  # a megabyte header: uvicorn's parser or our guard refuses it, never a 5xx
            r = httpx.post(url, json=body, headers={**ALICE, header: huge}, timeout=10)
            assert r.status_code in (400, 431)
        except httpx.TransportError:
            pass  # uvicorn's parser refused it and closed the connection
    r = httpx.post(hostile.v1 + "/requests/" + "r" * 300 + "/cancel", headers=ALICE)
    assert r.status_code == 400
    assert httpx.post(url, json=body, headers={**ALICE, "X-Session-Id": "s" * 256}).is_success


def test_non_ascii_user_works_end_to_end(hostile):
    """Accepted, pinned as a session, and cancellable by that same id (percent-encoded in the
    URL as any client would)."""
    url = hostile.v1 + "/completions"
    r = httpx.post(
        url, json={"prompt": [1, 2], "max_tokens": 2, "user": NON_ASCII_USER}, headers=ALICE
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    long = {**LONG, "max_tokens": 1000, "user": NON_ASCII_USER}
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(stream_times, url, long, ALICE)
        wait_in_flight(hostile)
        cancel = hostile.v1 + "/sessions/" + quote(NON_ASCII_USER, safe="") + "/cancel"
        assert httpx.post(cancel, headers=ALICE).json()["cancelled"] == 1
        assert running.result()[1] == "abort"


def test_stop_strings_are_bounded(hostile):
    url = hostile.v1 + "/completions"
    body = {"prompt": [1], "max_tokens": 1}
    for stop in (["x"] * 1000, [f"s{i}" for i in range(1000)], ["a" * 257]):
        r = httpx.post(url, json={**body, "stop": stop}, headers=ALICE)
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
    r = httpx.post(url, json={**body, "stop_token_ids": list(range(1000))}, headers=ALICE)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids"
    fine = [chr(0x41 + i) * 256 for i in range(16)]
    assert httpx.post(url, json={**body, "stop": fine}, headers=ALICE).status_code == 200


def test_one_key_cannot_cancel_or_join_another_keys_work(hostile):
    url = hostile.v1 + "/completions"
    ids = {"X-Request-Id": "shared", "X-Session-Id": "sess"}
    with ThreadPoolExecutor(1) as pool:
        bobs = pool.submit(stream_times, url, {**LONG, "max_tokens": 300}, {**BOB, **ids})
        wait_in_flight(hostile)
        # To alice, bob's request and session are absent.
        r = httpx.post(hostile.v1 + "/requests/shared/cancel", headers=ALICE)
        assert r.status_code == 404
        r = httpx.post(hostile.v1 + "/sessions/sess/cancel", headers=ALICE)
        assert r.status_code == 200 and r.json()["cancelled"] == 0
        # Bob is at his max_in_flight of 1.
        r = httpx.post(url, json={"prompt": [1], "max_tokens": 1}, headers=BOB)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "key_in_flight_limit"
        assert bobs.result()[1] == "length"  # alice changed nothing
        wait_idle(hostile)  # so that the count below is the next request's
        bobs = pool.submit(stream_times, url, {**LONG, "max_tokens": 1000}, {**BOB, **ids})
        wait_in_flight(hostile)
        assert httpx.post(hostile.v1 + "/requests/shared/cancel", headers=BOB).json()["cancelled"]
        assert bobs.result()[1] == "abort"
    wait_idle(hostile)


def test_http_hygiene_content_type_host_and_origin(hostile):
    url = hostile.v1 + "/completions"
    body = orjson.dumps({"prompt": [1], "max_tokens": 1})
    r = httpx.post(url, content=body, headers={**ALICE, "Content-Type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    r = httpx.post(url, content=body, headers=ALICE)  # no Content-Type at all
    assert r.status_code == 415
    port = urlsplit(hostile.url).port
    json_headers = {**ALICE, "Content-Type": "application/json"}
    r = httpx.post(url, content=body, headers={**json_headers, "Host": f"evil.example:{port}"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host"
    r = httpx.post(url, content=body, headers={**json_headers, "Host": f"localhost:{port}"})
    assert r.status_code == 200
    r = httpx.post(
        hostile.v1 + "/sessions/x/cancel", headers={**ALICE, "Origin": "https://evil.example"}
    )
    assert r.status_code == 403
    r = httpx.get(hostile.url + "/health", headers={"Host": "rebound.example"})
    assert r.status_code == 400


def test_error_bodies_carry_no_exception_text(hostile):
    worker = hostile.server.config.app.state.server.engine.worker

    def fail(batch) -> None:
        slow_step(batch)
        if any(seq.request_id.startswith("oops") for seq in batch.seqs):
            raise RuntimeError('SECRET-DETAIL in File "/opt/yaied/x.py", line 3')

    worker.fault_hook = fail
    try:
        url = hostile.v1 + "/completions"
        headers = {**ALICE, "X-Request-Id": "oops-1"}
        r = httpx.post(url, json={"prompt": [1], "max_tokens": 4}, headers=headers)
        assert r.status_code == 500
        body = {"prompt": [1], "max_tokens": 4, "stream": True}
        streamed = httpx.post(url, json=body, headers=headers).text
    finally:
        worker.fault_hook = slow_step
    for text in (r.text, streamed):
        assert "SECRET" not in text and "Traceback" not in text and "File " not in text
        assert "oops-1" in text  # the id to find it in the log by
    r = httpx.post(url, content=b"{not json", headers={**ALICE, "Content-Type": "application/json"})
    assert r.status_code == 400 and "Traceback" not in r.text


def test_slow_body_gets_408_and_a_client_that_stops_reading_is_cut_off(hostile, caplog):
    host, port = "127.0.0.1", urlsplit(hostile.url).port
    with socket.create_connection((host, port)) as sock:
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer sk-alice\r\n"
            "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
        )
        sock.sendall(head.encode())
        sock.settimeout(10)
        assert b" 408 " in sock.recv(4096).split(b"\r\n")[0] + b" "
    # A stream nobody reads: the server's sends block, time out after 1 s, and its call ends.
    # 32 x 1,000 chunks: megabytes, more than the loopback socket buffers hold.
    body = orjson.dumps({**LONG, "max_tokens": 1000, "stream": True, "n": 32})
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, port))
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer sk-alice\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    try:
        wait_in_flight(hostile, 32)
        assert manager_of(hostile).num_requests_in_flight == 32
        wait_idle(hostile, timeout=15)
        assert "client stopped reading" in caplog.text
    finally:
        threading.Thread(target=sock.close).start()
