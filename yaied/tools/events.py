"""What the tool-call parser hands the server: events while streaming, a message at the end.

The events map one to one onto OpenAI's streamed `delta` shapes: `ContentDelta` is
`delta.content`; `ToolCallStart` is the first `delta.tool_calls[]` entry of a call (index, id,
type "function", function.name); each `ToolCallArguments` is a `function.arguments` fragment of
the same index; `ToolCallEnd` carries nothing to send but tells the server the call is complete.
"""

from __future__ import annotations

import secrets
import string
from dataclasses import dataclass, field

_ID_ALPHABET = string.ascii_letters + string.digits


def new_call_id(prefix: str = "call_") -> str:
    """A call id: OpenAI's style by default ("call_" and 24 random letters and digits);
    Anthropic's tool_use ids take the prefix "toolu_"."""
    return prefix + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass(frozen=True, slots=True)
class ContentDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallStart:
    index: int  # position of the call in the message, from 0 (delta.tool_calls[].index)
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ToolCallArguments:
    index: int
    fragment: str  # the fragments of one call concatenate to its arguments_json


@dataclass(frozen=True, slots=True)
class ToolCallEnd:
    index: int


ToolEvent = ContentDelta | ToolCallStart | ToolCallArguments | ToolCallEnd


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments_json: str  # a JSON object as text, as OpenAI's function.arguments


@dataclass(frozen=True, slots=True)
class ParsedMessage:
    content: str | None  # None when the model wrote nothing but calls
    tool_calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # malformed calls, for logs; never for clients


def finish_reason(message: ParsedMessage, engine_reason: str) -> str:
    """The OpenAI finish_reason: "tool_calls" when the model stopped after calling, else the
    engine's. A "length" or "abort" stays: the client must learn the output was cut."""
    if message.tool_calls and engine_reason == "stop":
        return "tool_calls"
    return engine_reason
