"""A chat choice's text to OpenAI's message: the streamed deltas, assembled as a client does,
give the same reasoning, content and calls as the whole message, wherever the text is cut."""

from __future__ import annotations

import json

import pytest

from tests.tools.splitting import splits
from yaied.server.chat_output import ChatSettings, ChoiceMessage
from yaied.server.tool_request import ToolRequest
from yaied.tools.grammar import Tool, ToolChoice

TOOLS = ToolRequest([Tool("get_weather"), Tool("get_time")], ToolChoice("auto"))
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def assemble(deltas: list[dict]) -> dict:
    """What the openai SDK's stream helpers rebuild from chat deltas."""
    out: dict = {"content": None, "reasoning_content": None, "tool_calls": {}}
    for delta in deltas:
        for key in ("content", "reasoning_content"):
            if delta.get(key):
                out[key] = (out[key] or "") + delta[key]
        for call in delta.get("tool_calls", []):
            entry = out["tool_calls"].setdefault(call["index"], {"arguments": ""})
            for key in ("id", "type"):
                if key in call:
                    entry[key] = call[key]
            function = call["function"]
            if "name" in function:
                entry["name"] = function["name"]
            entry["arguments"] += function.get("arguments", "")
    return out


def whole(settings, tools, text, prompt=""):
    message = ChoiceMessage(settings, tools, prompt)
    message.feed(text)
    message.finish()
    return message


@pytest.mark.parametrize(
    "text, reasoning, content, calls",
    [
        ("Sunny.", None, "Sunny.", []),
        (CALL, None, None, ["get_weather"]),
        ("Let me check.\n" + CALL, None, "Let me check.", ["get_weather"]),
        ("<think>a <tool_call> b</think>\n\nSunny.", "a <tool_call> b", "Sunny.", []),
        ("<think>plan</think>\n" + CALL + "\n" + CALL, "plan", None, ["get_weather"] * 2),
    ],
)
def test_streamed_equals_whole_at_every_split(text, reasoning, content, calls):
    settings = ChatSettings("hermes", reasoning=True)
    message = whole(settings, TOOLS, text).message()
    assert message["content"] == content
    assert message.get("reasoning_content") == reasoning == message.get("reasoning")
    assert [c["function"]["name"] for c in message.get("tool_calls", [])] == calls
    for c in message.get("tool_calls", []):
        assert json.loads(c["function"]["arguments"]) == {"city": "Paris"}
    for pieces in splits(text, n_random=5):
        stream = ChoiceMessage(settings, TOOLS, "")
        deltas = [d for piece in pieces for d in stream.feed(piece)] + stream.finish()
        got = assemble(deltas)
        assert got["content"] == content and got["reasoning_content"] == reasoning
        names = [got["tool_calls"][i]["name"] for i in sorted(got["tool_calls"])]
        assert names == calls
        for entry in got["tool_calls"].values():
            assert entry["id"].startswith("call_") and entry["type"] == "function"
            assert json.loads(entry["arguments"]) == {"city": "Paris"}
        assert not any("<tool_call>" in (d.get("content") or "") for d in deltas)


def test_finish_reason_and_passthrough():
    message = whole(ChatSettings(), TOOLS, CALL)
    assert message.finish_reason("stop") == "tool_calls"
    assert message.finish_reason("length") == "length"  # a cut-off output says so
    plain = whole(ChatSettings(), ToolRequest(), "<tool_call> is text without tools")
    assert plain.message() == {"role": "assistant", "content": "<tool_call> is text without tools"}
    assert plain.finish_reason("stop") == "stop"
    empty = whole(ChatSettings(), ToolRequest(), "")
    assert empty.message()["content"] == ""  # as before tools existed: a string, not null


def test_reasoning_opened_by_the_prompt():
    settings = ChatSettings("hermes", reasoning=True)
    message = whole(settings, ToolRequest(), "step 1</think>\n\nDone.", prompt="...<think>\n")
    assert message.message()["reasoning_content"] == "step 1"
    assert message.message()["content"] == "Done."
