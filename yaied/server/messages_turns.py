"""The turn rules of Anthropic's ``messages``, checked before any block becomes a chat message.

Pure functions (messages_protocol.py calls them). Two rules the Messages API has that chat
completions leave to the template:

- Consecutive messages of one role are one turn (Anthropic combines them): their blocks are
  joined in order, so a template that wants alternating roles still gets them, and a tool
  loop whose results came back as two user messages reads as one.
- Tool uses and their results pair up turn by turn: every ``tool_result`` answers a
  ``tool_use`` of the assistant turn just before it, and every ``tool_use`` of an assistant
  turn that is followed by another turn has its ``tool_result`` there. Anthropic refuses a
  conversation that breaks either (400 invalid_request_error); so does this, naming the id
  and where it stands, rather than let the model read a result of nothing or a call with no
  answer. Within one turn two tool_use blocks may not share an id (a result could not say
  which it answers).

A ``role: "system"`` message (Anthropic's mid-conversation system messages, which Claude Code
sends its reminders as) is a turn of its own: a system message at that place in the prompt.
It may not come first (that is the top-level ``system``'s place) and holds text only; the
tool pairing reads the conversation around it, so a reminder after a tool result changes
nothing there.

Positions in the errors are the client's own (``messages[3].content[1]``), not the combined
turns'.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from yaied.server.errors import APIError


@dataclass(slots=True)
class Turn:
    role: str
    where: str  # the first of its messages, as the client numbered them
    blocks: list[tuple[str, Any]] = field(default_factory=list)  # (position, block)


_ROLES = ("user", "assistant", "system")


def turns(value: Any) -> list[Turn]:
    """The client's ``messages`` as turns: roles checked, runs of one role combined, a string
    content as one text block."""
    if not isinstance(value, list) or not value:
        raise APIError(400, "messages must be a non-empty list", param="messages")
    out: list[Turn] = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in _ROLES:
            raise APIError(400, f"{where}.role must be user, assistant or system", param=where)
        if i == 0 and message["role"] == "system":
            text = f"{where}: a system message cannot come first; send it as the top-level system"
            raise APIError(400, text, param=where)
        content = message.get("content")
        if isinstance(content, str):
            blocks = [(f"{where}.content", {"type": "text", "text": content})]
        elif isinstance(content, list):
            blocks = [(f"{where}.content[{j}]", block) for j, block in enumerate(content)]
        else:
            raise APIError(400, f"{where}.content must be a string or a list of blocks", where)
        if out and out[-1].role == message["role"]:
            out[-1].blocks += blocks
        else:
            out.append(Turn(message["role"], where, blocks))
    return out


def _of_kind(turn: Turn, kind: str) -> list[tuple[str, dict[str, Any]]]:
    return [(at, b) for at, b in turn.blocks if isinstance(b, dict) and b.get("type") == kind]


def check_tool_pairs(conversation: list[Turn]) -> None:
    """Every tool_result answers a tool_use of the turn before; every tool_use but the last
    turn's is answered in the turn after; no two tool_use ids of a turn alike. Run once the
    blocks are known well-formed (ids are strings)."""
    asked: dict[str, str] = {}  # the previous assistant turn's tool_use ids -> their position
    conversation = [turn for turn in conversation if turn.role != "system"]
    for n, turn in enumerate(conversation):
        if turn.role == "assistant":
            asked = {}
            for at, block in _of_kind(turn, "tool_use"):
                if block["id"] in asked:
                    text = f"{at}: tool_use id {block['id']!r} is used twice in one turn"
                    raise APIError(400, f"{text} (also at {asked[block['id']]})", param=at)
                asked[block["id"]] = at
            continue
        answered = set()
        for at, block in _of_kind(turn, "tool_result"):
            call_id = block["tool_use_id"]
            if call_id not in asked:
                text = (
                    f"{at}: tool_result for tool_use_id {call_id!r} answers no tool_use of the "
                    "assistant message just before it (each tool_result must follow its tool_use)"
                )
                raise APIError(400, text, param=at)
            answered.add(call_id)
        if n > 0:
            _all_answered(conversation[n - 1], asked, answered, turn.where)
        asked = {}


def _all_answered(previous: Turn, asked: dict[str, str], answered: set[str], where: str) -> None:
    missing = [call_id for call_id in asked if call_id not in answered]
    if missing:
        ids = ", ".join(repr(call_id) for call_id in missing)
        text = (
            f"{asked[missing[0]]}: tool_use id(s) {ids} of the assistant message "
            f"{previous.where} have no tool_result in the next user message ({where}); "
            "each tool_use needs one there"
        )
        raise APIError(400, text, param=asked[missing[0]])
