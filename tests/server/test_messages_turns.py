"""The turn rules of Anthropic's messages (messages_turns.py), read through parse_anthropic."""

from __future__ import annotations

import pytest

from yaied.server.errors import APIError
from yaied.server.messages_protocol import parse_anthropic

REMINDER = "Available agent types for the Agent tool: ..."


def _chat(messages, **extra):
    body = {"model": "m", "max_tokens": 8, "messages": messages, **extra}
    return parse_anthropic(body).parsed.messages


def test_a_system_message_mid_conversation_stays_where_it_was_sent():
    """Claude Code 2.1 sends its reminders as a ``role: "system"`` message after the user's
    (the mid-conversation system messages of Anthropic's current models): a system message at
    that place in the prompt, not a 400."""
    ask = {"role": "user", "content": [{"type": "text", "text": "List the files here."}]}
    chat = _chat([ask, {"role": "system", "content": REMINDER}], system="Be brief.")
    assert [(m["role"], m["content"]) for m in chat] == [
        ("system", "Be brief."), ("user", "List the files here."), ("system", REMINDER),
    ]  # fmt: skip
    blocks = [{"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}},
              {"type": "text", "text": "b"}]  # fmt: skip
    answer = {"role": "assistant", "content": "ok"}
    again = {"role": "user", "content": "go"}
    chat = _chat([ask, {"role": "system", "content": blocks}, answer, again])
    assert [m["role"] for m in chat] == ["user", "system", "assistant", "user"]
    assert chat[1]["content"] == "a\nb"


def test_a_system_message_between_a_tool_use_and_its_result_keeps_them_paired():
    call = {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.txt"}
    chat = _chat([
        {"role": "user", "content": "ls"}, {"role": "assistant", "content": [call]},
        {"role": "user", "content": [result]}, {"role": "system", "content": REMINDER},
    ])  # fmt: skip
    assert [m["role"] for m in chat] == ["user", "assistant", "tool", "system"]


@pytest.mark.parametrize(
    "messages, param, words",
    [
        ([{"role": "system", "content": "x"}, {"role": "user", "content": "hi"}],
         "messages[0]", "top-level system"),
        ([{"role": "user", "content": "hi"}, {"role": "system", "content": [
            {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}],
         "messages[1].content[0]", "system message cannot hold"),
        ([{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"}],
         "messages[1]", "user, assistant or system"),
    ],
)  # fmt: skip
def test_misplaced_or_malformed_system_messages_are_clear_400s(messages, param, words):
    with pytest.raises(APIError) as caught:
        _chat(messages)
    assert caught.value.status == 400 and caught.value.param == param
    assert words in caught.value.message
