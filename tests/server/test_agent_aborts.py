"""A call the engine aborts before it finishes (POST /v1/requests/{id}/cancel, the drain's abort
on a stop) under each agent API, with the official clients on the default model: it never ends
as if the model had finished. /v1/messages answers an error in Anthropic's shape (a stream's
``error`` event, a whole message's 500 ``api_error``, or 503 ``overloaded_error`` when the server
is draining); /v1/responses ends ``failed``, its output items ``incomplete``."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time

import anthropic
import httpx
import pytest

from tests.server.conftest import MODEL

LONG = [{"role": "user", "content": "Count from 1 to 500, one number a line."}]
LONG_ASK = dict(model=MODEL, max_tokens=900, messages=LONG, extra_body={"temperature": 0})


@pytest.fixture
def client(live):
    return anthropic.Anthropic(base_url=live.url, api_key="none", max_retries=0)


def _cancel(live, request_id: str) -> None:
    response = httpx.post(f"{live.url}/v1/requests/{request_id}/cancel")
    assert response.json()["cancelled"] >= 1, response.text


def _wait_running(live, request_id: str) -> None:
    """Until the call of ``request_id`` runs in the engine (a cancel finds it)."""
    manager = live.server.config.app.state.server.manager
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if any(call.client_id == request_id for call in list(manager._calls.values())):
            return
        time.sleep(0.01)
    raise AssertionError(f"{request_id} never ran")


@contextlib.contextmanager
def _draining(live):
    """The drain of a stop, cut to no wait: every running call is aborted while the server
    refuses new work; served again after the block."""
    state = live.server.config.app.state.server
    loop = live.server.servers[0].get_loop()
    try:
        yield lambda: asyncio.run_coroutine_threadsafe(state.drain(0.0, 5.0), loop).result(10)
    finally:
        state.draining = False


def test_a_cancelled_message_stream_ends_with_an_error_event(client, live):
    headers = {"X-Request-Id": "msg-cancel-stream"}
    kinds = []
    with (
        pytest.raises(anthropic.APIStatusError) as info,
        client.messages.stream(**LONG_ASK, extra_headers=headers) as stream,
    ):
        for event in stream:
            kinds.append(event.type)
            if event.type == "content_block_delta" and kinds.count(event.type) == 3:
                _cancel(live, "msg-cancel-stream")
    assert "message_delta" not in kinds and "message_stop" not in kinds
    assert info.value.body["error"]["type"] == "api_error"
    assert "aborted" in info.value.body["error"]["message"]


def test_a_cancelled_message_is_an_api_error_not_end_turn(client, live):
    headers = {"X-Request-Id": "msg-cancel-whole"}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(client.messages.create, **LONG_ASK, extra_headers=headers)
        _wait_running(live, "msg-cancel-whole")
        _cancel(live, "msg-cancel-whole")
        with pytest.raises(anthropic.InternalServerError) as info:
            pending.result(60)
    assert info.value.status_code == 500 and info.value.body["error"]["type"] == "api_error"
    # a cancel is deliberate: the client's retries must not run the call again
    assert info.value.response.headers["x-should-retry"] == "false"


def test_a_drained_message_is_overloaded(client, live):
    with _draining(live) as drain, concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(
            client.messages.create, **LONG_ASK, extra_headers={"X-Request-Id": "msg-drain-whole"}
        )
        _wait_running(live, "msg-drain-whole")
        drain()
        with pytest.raises(anthropic.APIStatusError) as info:
            pending.result(60)
    assert info.value.status_code == 503
    assert info.value.body["error"]["type"] == "overloaded_error"
    assert info.value.response.headers["retry-after"]
    with (
        _draining(live) as drain,
        pytest.raises(anthropic.APIStatusError) as info,
        client.messages.stream(**LONG_ASK) as stream,
    ):
        for event in stream:
            if event.type == "content_block_delta":
                drain()
    assert info.value.body["error"]["type"] == "overloaded_error"
