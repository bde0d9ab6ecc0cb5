"""Anthropic's context management edits on chat messages: what clear_tool_uses clears and
keeps, when it applies, and the 400s of malformed edits."""

from __future__ import annotations

import asyncio

import pytest

from yaied.server.context_edits import (
    PLACEHOLDER,
    ClearToolUses,
    apply_edits,
    clear_tool_uses,
    parse_context_management,
)
from yaied.server.errors import APIError


def conversation(names: list[str]) -> list[dict]:
    messages = [{"role": "user", "content": "Do the jobs."}]
    for i, name in enumerate(names):
        call = {"id": f"c{i}", "type": "function",
                "function": {"name": name, "arguments": f'{{"job": {i}}}'}}  # fmt: skip
        result = {"role": "tool", "tool_call_id": f"c{i}", "content": f"result {i} " * 50}
        messages += [{"role": "assistant", "content": "", "tool_calls": [call]}, result]
    return messages


def test_all_but_the_last_uses_are_cleared_excluded_tools_kept():
    messages = conversation(["read", "read", "bash", "read", "read"])
    edit = ClearToolUses(
        keep=2, exclude_tools=frozenset({"bash"}), clear_inputs=frozenset({"read"})
    )
    out, cleared = clear_tool_uses(messages, edit)
    assert cleared == 2  # c0, c1 (c2 is bash, c3 and c4 kept)
    results = [m["content"] for m in out if m["role"] == "tool"]
    assert (
        results[:2] == [PLACEHOLDER] * 2
        and results[2:] == [m["content"] for m in messages if m["role"] == "tool"][2:]
    )
    arguments = [
        m["tool_calls"][0]["function"]["arguments"] for m in out if m["role"] == "assistant"
    ]
    assert arguments[:2] == ["{}", "{}"] and arguments[2] == '{"job": 2}'
    assert messages[2]["content"].startswith("result 0")  # the request's own list is untouched


def test_edits_apply_past_the_trigger_and_clear_at_least():
    messages = conversation(["a", "b", "c", "d"])

    async def length(ms):  # a prompt's "tokens": its characters
        return sum(len(m["content"]) for m in ms)

    def run(**fields):
        return asyncio.run(apply_edits([ClearToolUses(**fields)], messages, length))

    total = asyncio.run(length(messages))
    assert run(trigger=total)[1] == []  # at the trigger, not past it: nothing
    out, applied = run(trigger=10, keep=1)
    assert applied == [{"type": "clear_tool_uses_20250919", "cleared_tool_uses": 3,
                        "cleared_input_tokens": total - asyncio.run(length(out))}]  # fmt: skip
    assert run(trigger=10, keep=1, clear_at_least=10**6)[1] == []  # would clear too little
    assert run(trigger=10, keep=4)[1] == []  # nothing older than the kept uses


def test_thinking_edit_counts_the_turns_beyond_keep():
    body = {"messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "a", "signature": ""},
                                          {"type": "text", "text": "y"}]},
        {"role": "user", "content": "z"},
        {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "q"}]},
    ]}  # fmt: skip
    keep_one = {"type": "thinking_turns", "value": 1}
    body["context_management"] = {"edits": [{"type": "clear_thinking_20251015", "keep": keep_one}]}
    edits = parse_context_management(body)
    _, applied = asyncio.run(apply_edits(edits, [], None))
    assert applied == [{"type": "clear_thinking_20251015", "cleared_thinking_turns": 1,
                        "cleared_input_tokens": 0}]  # fmt: skip


@pytest.mark.parametrize(
    ("value", "param"),
    [
        ([], "context_management"),
        ({"edits": [{"type": "compact_20260112"}]}, "context_management.edits[0].type"),
        ({"edits": [{"type": "clear_tool_uses_20250919",
                     "keep": {"type": "tool_uses", "value": -1}}]},
         "context_management.edits[0].keep"),
        ({"edits": [{"type": "clear_tool_uses_20250919", "trigger": 5}]},
         "context_management.edits[0].trigger"),
        ({"edits": [{"type": "clear_tool_uses_20250919", "colour": "red"}]},
         "context_management.edits[0].colour"),
        ({"edits": [{"type": "clear_tool_uses_20250919"}, {"type": "clear_thinking_20251015"}]},
         "context_management.edits[1]"),
    ],
)  # fmt: skip
def test_malformed_edits_are_refused(value, param):
    with pytest.raises(APIError) as caught:
        parse_context_management({"messages": [], "context_management": value})
    assert caught.value.status == 400 and caught.value.param == param
