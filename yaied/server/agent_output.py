"""A chat choice's stream deltas as a sequence of output blocks, the unit both agent APIs speak.

The Responses API's output items (reasoning, message, function_call) and the Messages API's
content blocks (thinking, text, tool_use) are the same thing: an ordered list of blocks, each
opened, grown by deltas and closed. `Blocks` reads the deltas chat_output.ChoiceMessage
releases (the same parsers as chat completions, so every API splits text the same way) and
turns them into `BlockEvent`s; each API renders those events in its own shape, streaming or
collected into one body.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

BlockKind = Literal["reasoning", "text", "tool_call"]


@dataclass(slots=True)
class Block:
    kind: BlockKind
    index: int  # place in the output
    parts: list[str] = field(default_factory=list)  # text, reasoning or the call's arguments
    call_id: str = ""  # tool_call: the parser's id (call_...)
    name: str = ""  # tool_call: the function

    @property
    def text(self) -> str:
        return "".join(self.parts)


@dataclass(frozen=True, slots=True)
class BlockEvent:
    action: Literal["start", "delta", "stop"]
    block: Block
    delta: str = ""


class Blocks:
    """Chat deltas in, block events out; `blocks` is the whole output once `close` ran."""

    def __init__(self) -> None:
        self.blocks: list[Block] = []
        self._open: Block | None = None
        self._calls: dict[int, Block] = {}  # the parser's call index -> its block

    def feed(self, deltas: list[dict[str, Any]]) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        for delta in deltas:
            if delta.get("reasoning_content"):
                events += self._grow("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                events += self._grow("text", delta["content"])
            for call in delta.get("tool_calls") or ():
                events += self._call(call)
        return events

    def close(self) -> list[BlockEvent]:
        if self._open is None:
            return []
        block, self._open = self._open, None
        return [BlockEvent("stop", block)]

    def _start(self, kind: BlockKind, **names: str) -> list[BlockEvent]:
        events = self.close()
        block = Block(kind, len(self.blocks), **names)
        self.blocks.append(block)
        self._open = block
        return [*events, BlockEvent("start", block)]

    def _grow(self, kind: BlockKind, text: str) -> list[BlockEvent]:
        events = []
        if self._open is None or self._open.kind != kind:
            events = self._start(kind)
        block = self._open
        assert block is not None
        block.parts.append(text)
        return [*events, BlockEvent("delta", block, text)]

    def _call(self, call: dict[str, Any]) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        function = call.get("function") or {}
        block = self._calls.get(call["index"])
        if block is None:  # a new call: its id and name come first, arguments after
            events = self._start("tool_call", call_id=call.get("id", ""), name=function["name"])
            block = self._calls[call["index"]] = self._open
            assert block is not None
        fragment = function.get("arguments") or ""
        if fragment:
            block.parts.append(fragment)
            events.append(BlockEvent("delta", block, fragment))
        return events


def finish_kind(engine_reason: str | None, blocks: list[Block]) -> str:
    """Why the output ended, in API-neutral words: tool_calls, length, stop or error."""
    if engine_reason == "length":
        return "length"
    if engine_reason in ("error", "abort"):
        return "error"
    if any(block.kind == "tool_call" for block in blocks):
        return "tool_calls"
    return "stop"
