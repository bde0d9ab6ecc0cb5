"""A call the engine aborts before it finishes (POST /v1/requests/{id}/cancel, the drain's abort
on a stop) under each agent API, with the official clients on the default model: it never ends
as if the model had finished. /v1/messages answers an error in Anthropic's shape (a stream's
``error`` event, a whole message's 500 ``api_error``, or 503 ``overloaded_error`` when the server
is draining); /v1/responses ends ``failed``, the output item it stopped in ``incomplete``."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time

import anthropic
import httpx
import pytest

from tests.server.conftest import MODEL

# An ask the default model answers at length (greedy, it writes past 600 tokens): a cancel must
# find the call running ("Count from 1 to 500" got 9 tokens, often done before the cancel came).
LONG = [{"role": "user", "content": "Write a long story about a dragon who learns to bake bread."}]
LONG_ASK = dict(model=MODEL, max_tokens=900, messages=LONG, extra_body={"temperature": 0})


@pytest.fixture
def client(live):
    return anthropic.Anthropic(base_url=live.url, api_key="none", max_retries=0)


def _cancel(live, request_id: str) -> None:
    response = httpx.post(f"{live.url}/v1/requests/{request_id}/cancel")
    assert response.status_code == 200 and response.json()["cancelled"] >= 1, response.text


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


@pytest.fixture
def openai_client(live):
    import openai

    return openai.OpenAI(base_url=live.v1, api_key="none", max_retries=0)


def test_a_cancelled_responses_items_are_incomplete(openai_client, live):
    """A response that ends failed (a cancel) lists the item it stopped in as incomplete, never
    completed: in the streamed output_item.done, response.failed, and the stored object."""
    headers = {"X-Request-Id": "resp-cancel-items"}
    with openai_client.responses.stream(
        model=MODEL, input=LONG[0]["content"], max_output_tokens=900, temperature=0,
        extra_headers=headers,
    ) as stream:  # fmt: skip
        events, deltas = [], 0
        for event in stream:
            events.append(event)
            deltas += event.type == "response.output_text.delta"
            if event.type == "response.output_text.delta" and deltas == 3:
                _cancel(live, "resp-cancel-items")
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert done and all(item.status == "incomplete" for item in done), done
    failed = events[-1]
    assert failed.type == "response.failed" and failed.response.error.code == "cancelled"
    assert [item.status for item in failed.response.output] == ["incomplete"]
    stored = openai_client.responses.retrieve(failed.response.id)
    assert stored.status == "failed" and stored.output[0].status == "incomplete"


def test_items_cut_by_max_output_tokens_are_incomplete(openai_client):
    ask = dict(model=MODEL, input=LONG[0]["content"], max_output_tokens=5, temperature=0)
    whole = openai_client.responses.create(**ask)
    assert whole.status == "incomplete" and whole.output[-1].status == "incomplete"
    with openai_client.responses.stream(**ask) as stream:
        events = list(stream)  # the client's final response is a response.completed's only
    done = [e.item for e in events if e.type == "response.output_item.done"]
    final = events[-1]
    assert final.type == "response.incomplete", final.type
    assert done[-1].status == "incomplete" and final.response.output[-1].status == "incomplete"
    assert openai_client.responses.retrieve(whole.id).output[-1].status == "incomplete"


def test_a_cancelled_background_responses_items_are_incomplete(openai_client, live):
    started = openai_client.responses.create(
        model=MODEL, input=LONG[0]["content"], max_output_tokens=900, temperature=0,
        background=True,
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while openai_client.responses.retrieve(started.id).status == "queued":  # no output yet
        assert time.monotonic() < deadline
        time.sleep(0.01)
    cancelled = openai_client.responses.cancel(started.id)
    assert cancelled.status == "cancelled" and cancelled.output
    assert all(item.status == "incomplete" for item in cancelled.output)
    stored = openai_client.responses.retrieve(started.id)
    assert all(item.status == "incomplete" for item in stored.output)
