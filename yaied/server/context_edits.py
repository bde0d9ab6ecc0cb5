"""Anthropic's context management on ``/v1/messages`` (``context_management.edits``, the beta
``context-management-2025-06-27``): the server trims a long agent conversation before the model
reads it, and says what it did in the answer's ``context_management.applied_edits``.

- ``clear_tool_uses_20250919``: once the rendered prompt is longer than ``trigger`` input tokens
  (100,000 by default), the results of every tool use but the last ``keep`` (3) are replaced by
  a short placeholder, tools named in ``exclude_tools`` left alone; ``clear_tool_inputs`` (true,
  or a list of tool names) clears those uses' inputs too. With ``clear_at_least``, an edit that
  would clear fewer tokens than that is not applied. The prompt is rendered again to count what
  was cleared, so ``cleared_input_tokens`` is exact.
- ``clear_thinking_20251015``: thinking blocks sent back never reach the model here (chat
  templates drop earlier turns' thinking), so this edit has nothing left to do; it is accepted,
  and reports the thinking turns beyond ``keep`` as cleared, with no tokens.

Every fault is a 400 naming the field, in the API's own shape (error_shape.py).
"""

from __future__ import annotations

import copy
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from yaied.server.errors import APIError

CLEAR_TOOL_USES = "clear_tool_uses_20250919"
CLEAR_THINKING = "clear_thinking_20251015"
PLACEHOLDER = "[tool result cleared to save context]"
_PARAM = "context_management"


@dataclass(frozen=True, slots=True)
class ClearToolUses:
    trigger: int = 100_000
    keep: int = 3
    clear_at_least: int = 0
    exclude_tools: frozenset[str] = frozenset()
    clear_inputs: bool | frozenset[str] = False


@dataclass(frozen=True, slots=True)
class ClearThinking:
    keep: int | None = 1  # thinking turns kept; None: all
    turns: int = 0  # assistant turns of the request that carried thinking blocks


Edit = ClearToolUses | ClearThinking


def parse_context_management(body: dict[str, Any]) -> list[Edit]:
    value = body.get(_PARAM)
    if value is None:
        return []
    edits = value.get("edits") if isinstance(value, dict) else None
    if not isinstance(edits, list) or set(value) - {"edits"}:
        raise APIError(400, f"{_PARAM} is {{edits: [...]}}", param=_PARAM)
    out: list[Edit] = []
    for i, edit in enumerate(edits):
        where = f"{_PARAM}.edits[{i}]"
        kind = edit.get("type") if isinstance(edit, dict) else None
        if kind == CLEAR_TOOL_USES:
            out.append(_clear_tool_uses(edit, where))
        elif kind == CLEAR_THINKING:
            if out:  # as Anthropic requires
                raise APIError(400, f"{where}: {CLEAR_THINKING} must come first", where)
            out.append(_clear_thinking(edit, where, body.get("messages")))
        else:
            text = f"{where}.type must be {CLEAR_TOOL_USES} or {CLEAR_THINKING}"
            raise APIError(400, text, param=f"{where}.type")
    return out


def _clear_tool_uses(edit: dict[str, Any], where: str) -> ClearToolUses:
    _only(edit, where, {"type", "trigger", "keep", "clear_at_least", "exclude_tools",
                        "clear_tool_inputs"})  # fmt: skip
    exclude = edit.get("exclude_tools") or []
    inputs = edit.get("clear_tool_inputs", False)
    if not isinstance(exclude, list) or not all(isinstance(n, str) for n in exclude):
        raise APIError(400, f"{where}.exclude_tools must be a list of names", where)
    if not isinstance(inputs, bool):
        if not isinstance(inputs, list) or not all(isinstance(n, str) for n in inputs):
            raise APIError(400, f"{where}.clear_tool_inputs is a boolean or tool names", where)
        inputs = frozenset(inputs)
    return ClearToolUses(
        trigger=_amount(edit, "trigger", "input_tokens", 100_000, where),
        keep=_amount(edit, "keep", "tool_uses", 3, where),
        clear_at_least=_amount(edit, "clear_at_least", "input_tokens", 0, where),
        exclude_tools=frozenset(exclude),
        clear_inputs=inputs,
    )


def _clear_thinking(edit: dict[str, Any], where: str, messages: Any) -> ClearThinking:
    _only(edit, where, {"type", "keep"})
    keep: int | None = 1
    if edit.get("keep") == "all":
        keep = None
    elif edit.get("keep") is not None:
        keep = _amount(edit, "keep", "thinking_turns", 1, where)
    turns = 0
    for message in messages if isinstance(messages, list) else []:
        blocks = message.get("content") if isinstance(message, dict) else None
        if isinstance(blocks, list) and message.get("role") == "assistant":
            kinds = {b.get("type") for b in blocks if isinstance(b, dict)}
            turns += bool(kinds & {"thinking", "redacted_thinking"})
    return ClearThinking(keep, turns)


def _only(edit: dict[str, Any], where: str, known: set[str]) -> None:
    extra = sorted(set(edit) - known)
    if extra:
        raise APIError(
            400, f"{where}.{extra[0]} is not a field of this edit", f"{where}.{extra[0]}"
        )


def _amount(edit: dict[str, Any], name: str, unit: str, default: int, where: str) -> int:
    """A ``{"type": unit, "value": n}`` field (n >= 0), or its default."""
    value = edit.get(name)
    if value is None:
        return default
    if (
        not isinstance(value, dict)
        or value.get("type") != unit
        or not isinstance(value.get("value"), int)
        or isinstance(value.get("value"), bool)
        or value["value"] < 0
    ):
        text = f'{where}.{name} is {{"type": "{unit}", "value": <a count, 0 or more>}}'
        raise APIError(400, text, param=f"{where}.{name}")
    return value["value"]


async def apply_edits(
    edits: list[Edit],
    messages: list[dict[str, Any]],
    prompt_tokens: Callable[[list[dict[str, Any]]], Awaitable[int]],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The chat messages after the edits, and the applied edits as the answer lists them.
    ``prompt_tokens`` renders messages and counts the prompt's tokens."""
    applied = []
    for edit in edits:
        if isinstance(edit, ClearThinking):
            cleared = edit.turns - (edit.turns if edit.keep is None else min(edit.keep, edit.turns))
            if cleared:
                applied.append({"type": CLEAR_THINKING, "cleared_thinking_turns": cleared,
                                "cleared_input_tokens": 0})  # fmt: skip
            continue
        before = await prompt_tokens(messages)
        if before <= edit.trigger:
            continue
        trimmed, uses = clear_tool_uses(messages, edit)
        if not uses:
            continue
        cleared_tokens = before - await prompt_tokens(trimmed)
        if cleared_tokens < edit.clear_at_least:
            continue
        messages = trimmed
        applied.append({"type": CLEAR_TOOL_USES, "cleared_tool_uses": uses,
                        "cleared_input_tokens": cleared_tokens})  # fmt: skip
    return messages, applied


def clear_tool_uses(
    messages: list[dict[str, Any]], edit: ClearToolUses
) -> tuple[list[dict[str, Any]], int]:
    """``messages`` (chat's: assistant ``tool_calls``, ``tool`` results) with the results of all
    but the last ``keep`` tool uses replaced, and how many uses were cleared."""
    calls = [call for m in messages if m["role"] == "assistant" for call in m.get("tool_calls", [])]
    older = calls[: max(0, len(calls) - edit.keep)]
    cleared = {c["id"] for c in older if c["function"]["name"] not in edit.exclude_tools}
    if not cleared:
        return messages, 0
    out = copy.deepcopy(messages)
    for message in out:
        if message["role"] == "tool" and message.get("tool_call_id") in cleared:
            message["content"] = PLACEHOLDER
        for call in message.get("tool_calls", []) if message["role"] == "assistant" else []:
            name = call["function"]["name"]
            inputs = edit.clear_inputs
            if call["id"] in cleared and (inputs is True or (inputs and name in inputs)):
                call["function"]["arguments"] = "{}"
    return out, len(cleared)
