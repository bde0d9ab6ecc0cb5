"""/v1/messages with a max_tokens past what the context has left: Claude Code and other agents
send a fixed large max_tokens (32,000) whatever the model's window. As Anthropic's current models
do, the call runs to the context's end and says so with stop_reason
"model_context_window_exceeded"; it is not refused."""

from __future__ import annotations

import re

import orjson
import pytest

from tests.server.conftest import engine_loader, in_process_server
from yaied.server.config import ServerConfig

CONTEXT = 160
ASK = {"model": "tiny", "messages": [{"role": "user", "content": "Count on."}]}
GREEDY = {"temperature": 0, "top_k": 1}


@pytest.fixture(scope="module")
def tiny_chat(tiny_chat_model):
    loader = engine_loader(model=str(tiny_chat_model), max_model_len=CONTEXT, threads=1)
    with in_process_server(ServerConfig(served_model_name="tiny"), loader, "ignored") as client:
        yield client


def _create(client, max_tokens: int):
    response = client.post("/v1/messages", json={**ASK, **GREEDY, "max_tokens": max_tokens})
    assert response.status_code == 200, response.text
    return response.json()


def _window_used(message) -> int:
    usage = message["usage"]
    return usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["output_tokens"]


def test_a_max_tokens_past_the_context_runs_to_its_end(tiny_chat):
    message = _create(tiny_chat, 32000)
    assert message["stop_reason"] == "model_context_window_exceeded"
    assert _window_used(message) == CONTEXT


def test_a_max_tokens_that_fits_stops_there_as_before(tiny_chat):
    room = CONTEXT - _window_used(_create(tiny_chat, 1)) + 1
    exact = _create(tiny_chat, room)  # the client's own limit is the context's: max_tokens
    assert exact["stop_reason"] == "max_tokens" and _window_used(exact) == CONTEXT
    fewer = _create(tiny_chat, 5)
    assert fewer["stop_reason"] == "max_tokens" and fewer["usage"]["output_tokens"] == 5


def test_a_streamed_call_says_so_in_its_message_delta(tiny_chat):
    body = {**ASK, **GREEDY, "max_tokens": 32000, "stream": True}
    with tiny_chat.stream("POST", "/v1/messages", json=body) as response:
        assert response.status_code == 200
        events = [
            orjson.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")
        ]
    delta = next(e for e in events if e["type"] == "message_delta")
    assert delta["delta"]["stop_reason"] == "model_context_window_exceeded"
    assert events[-1]["type"] == "message_stop"


def test_a_prompt_that_fills_the_context_is_still_refused(tiny_chat):
    long = {"role": "user", "content": "word " * (2 * CONTEXT)}
    response = tiny_chat.post("/v1/messages", json={**ASK, "messages": [long], "max_tokens": 32000})
    assert response.status_code == 400, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    message = body["error"]["message"]
    assert "max_tokens" not in message  # Claude Code's 32,000 is not what is wrong
    # In Anthropic's words, which Claude Code matches (this pattern) to compact the
    # conversation by the tokens it is over, rather than end the session on an error
    found = re.search(r"prompt is too long[^0-9]*(\d+)\s*tokens?\s*>\s*(\d+)", message)
    assert found, message
    counted = tiny_chat.post("/v1/messages/count_tokens", json={**ASK, "messages": [long]})
    assert (int(found[1]), int(found[2])) == (counted.json()["input_tokens"], CONTEXT)
