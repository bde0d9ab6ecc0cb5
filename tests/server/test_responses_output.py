"""The response object and its streamed events as responses_output.py builds them, without a
server: an item's status in the streamed ``response.output_item.done`` is the status the final
response (and the stored one) gives it, whatever the response ended with."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from yaied.server.responses_output import SSEWriter, Turn, block_events
from yaied.server.responses_protocol import parse_responses

# the model wrote a sentence, then began a call: the call is what an abort or the cut stops
DELTAS = [
    [{"content": "Let me check."}],
    [{"tool_calls": [{"index": 0, "id": "call_1", "function": {"name": "w", "arguments": ""}}]}],
    [{"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Pa'}}]}],
]
TOOLS = [{"type": "function", "name": "w", "parameters": {"type": "object"}}]


def _streamed(ending: str) -> tuple[dict[str, str], Turn]:
    """The status each item's output_item.done carried, as responses_running.events sends them:
    the ending is known only once the last event is in, before the blocks close."""
    turn = Turn(parse_responses({"input": "Weather?", "tools": TOOLS}), "resp_abc", "m")
    write, chunks = SSEWriter(), []
    for deltas in DELTAS:
        for event in turn.blocks.feed(deltas):
            chunks += block_events(turn, write, event)
    turn.ending = ending
    for event in turn.blocks.close():
        chunks += block_events(turn, write, event)
    done = {}
    for chunk in chunks:
        payload = json.loads(chunk.split(b"data: ", 1)[1])
        if payload["type"] == "response.output_item.done":
            done[payload["item"]["id"]] = payload["item"]["status"]
    return done, turn


@pytest.mark.parametrize("ending", ["completed", "incomplete", "failed", "cancelled"])
def test_streamed_item_statuses_are_the_final_responses(ending):
    done, turn = _streamed(ending)
    final = {item["id"]: item["status"] for item in turn.body(ending)["output"]}
    assert done == final, (ending, done, final)
    # the sentence finished before the end came; the call did not, unless all went well
    cut = "completed" if ending == "completed" else "incomplete"
    assert list(final.values()) == ["completed", cut]


def test_the_body_carries_completed_at_and_its_conversation():
    """OpenAI's completed_at (only once completed) and the conversation the turn ran in."""
    turn = Turn(parse_responses({"input": "Hi", "conversation": "conv_1"}), "resp_abc", "m")
    for status in ("queued", "in_progress", "incomplete", "failed"):
        assert turn.body(status)["completed_at"] is None
    completed = turn.body("completed")
    assert completed["completed_at"] >= completed["created_at"]
    assert turn.body("completed")["completed_at"] == completed["completed_at"]  # fixed once
    assert completed["conversation"] == {"id": "conv_1"}
    alone = Turn(parse_responses({"input": "Hi"}), "resp_x", "m")
    assert alone.body("completed")["conversation"] is None


def test_the_usage_validates_as_the_clients_response_usage():
    """The official client's ResponseUsage requires input_tokens_details.cache_write_tokens:
    left out, the client read it as None, which breaks a sum over a usage's counts."""
    from openai.types.responses import ResponseUsage

    turn = Turn(parse_responses({"input": "Hi"}), "resp_abc", "m")
    run = SimpleNamespace(usage=(31, 4, 16))  # (prompt, output, cached) tokens, as AgentRun's
    usage = ResponseUsage.model_validate(turn.body("completed", run)["usage"])
    assert usage.input_tokens_details.cached_tokens == 16
    assert usage.input_tokens_details.cache_write_tokens == 0
    assert usage.total_tokens == 35
