"""A chat choice's text as OpenAI's message: reasoning, content and tool calls.

The engine streams plain text. With a reasoning parser configured (``--reasoning-parser``), the
``<think>`` block goes to ``reasoning_content`` (and, with the same text, ``reasoning``, the
newer name); with tools active, the rest goes through the tool-call parser of the model's format
(``--tool-call-parser``, else the chat template's, else the fallback), so calls come out as
``tool_calls`` and their markup never reaches ``content``. Streaming and whole responses run the
same parsers, so they agree on every split of the text.

`ChatSettings` is per server (the format and parser names); `output_grammar` is what a request
must match once tools or reasoning take part (`output_refused`: which part is at fault when that
does not compile); `ChoiceMessage` is per choice.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from yaied.core.grammar_spec import GrammarSpec, StructuredOutputError, make_spec
from yaied.server.errors import APIError
from yaied.server.protocol import ParsedRequest
from yaied.server.tool_request import ToolRequest
from yaied.tools import (
    FALLBACK_FORMAT,
    ContentDelta,
    ReasoningParser,
    ToolCallArguments,
    ToolCallParser,
    ToolCallStart,
    ToolEvent,
    detect_format,
    new_call_id,
    prompt_opens_reasoning,
)
from yaied.tools.custom import InputStream, input_of
from yaied.tools.grammar import output_structural_tag


@dataclass(frozen=True, slots=True)
class ChatSettings:
    """How this server's model writes tool calls and whether it reasons."""

    tool_format: str = FALLBACK_FORMAT
    reasoning: bool = False

    @classmethod
    def resolve(
        cls, template: str | None, tool_call_parser: str = "", reasoning_parser: str = ""
    ) -> ChatSettings:
        """The flag's format, else the one the chat template writes, else the fallback (the
        format render.py describes to templates that know no tools)."""
        fmt = detect_format(template, tool_call_parser or None) or FALLBACK_FORMAT
        return cls(fmt, bool(reasoning_parser))


def output_grammar(
    parsed: ParsedRequest, settings: ChatSettings, prompt_text: str
) -> GrammarSpec | None:
    """The constraint a chat request's output runs under: the request's own (response_format),
    or a structural tag that adds the tool calls and the reasoning block to it."""
    tools = parsed.tools
    reasoning = prompt_opens_reasoning(prompt_text) if settings.reasoning else None
    tag = output_structural_tag(
        tool_format=settings.tool_format,
        tools=tools.tools,
        choice=tools.choice,
        parallel=tools.parallel,
        constraint=parsed.structured,
        reasoning=reasoning,
    )
    if tag is None:
        return parsed.structured
    param = "tools" if tools.active else parsed.structured.param if parsed.structured else ""
    try:
        return make_spec("structural_tag", tag, param)
    except StructuredOutputError as exc:
        raise APIError(400, exc.message, param=exc.param) from None


# What the compiler says of a structural tag it refuses (structured/compiler.py's _reason).
_TAG_ERROR = "invalid structural tag: "


async def output_refused(
    grammars: Any, parsed: ParsedRequest, exc: StructuredOutputError
) -> APIError:
    """The 400 for a chat request's output grammar (output_grammar's structural tag, which
    holds the request's own constraint, its tools and its reasoning block) that did not
    compile: the request's own constraint when that would not compile on its own, named by its
    field with the words it has without tools (response_format, text.format); else the first
    tool whose arguments' schema (a custom tool's: format) would not, named by the API's field
    and the tool's name, and why; else the grammar's error, as the tools' together.
    ``grammars``: the engine's."""
    own = parsed.own_structured
    if own is not None and (refused := await grammars.first_refused([own])) is not None:
        return APIError(400, refused.message, param=refused.param)
    if not parsed.tools.active or exc.param != "tools":
        return APIError(400, exc.message, param=exc.param)
    specs = parsed.tools.argument_specs()
    refused = await grammars.first_refused(spec for _, spec in specs)
    if refused is not None:
        name = next(name for name, spec in specs if spec.param == refused.param)
        message = f"{refused.param} (tool {name!r}) cannot be enforced: {refused.message}"
        return APIError(400, message, param=refused.param)
    message = exc.message
    if message.startswith(_TAG_ERROR):  # not, say, a compile past the timeout
        message = "the tools cannot be enforced together: " + message[len(_TAG_ERROR) :]
    return APIError(400, message, param=exc.param)


class ChoiceMessage:
    """One choice's parsers. `feed` each text delta, `finish` once; both return the stream
    deltas they release, in order (each becomes one chunk). `message` is the whole message."""

    def __init__(self, settings: ChatSettings, tools: ToolRequest, prompt_text: str) -> None:
        self._reasoning = None
        if settings.reasoning:
            starts_inside = prompt_opens_reasoning(prompt_text)
            self._reasoning = ReasoningParser(starts_in_reasoning=starts_inside)
        self._calls = None
        if tools.active:
            names = [tool.name for tool in tools.tools]
            # output_grammar forces every call's markup whenever tools are active, so a call's
            # arguments can go out as they come (the parser's stream_arguments)
            self._calls = ToolCallParser(
                settings.tool_format,
                tool_names=names,
                stream_arguments=True,
                id_factory=functools.partial(new_call_id, tools.call_id_prefix),
            )
        self._text: list[str] = []  # without parsers: the content as it came
        # chat's custom tools: their calls' streamed inputs, by call index
        self._custom = tools.custom
        self._inputs: dict[int, InputStream] = {}

    @property
    def parses(self) -> bool:
        return self._reasoning is not None or self._calls is not None

    def feed(self, text: str) -> list[dict[str, Any]]:
        if not self.parses:
            self._text.append(text)
            return [{"content": text}] if text else []
        if self._reasoning is None:
            return self._content(text, final=False)
        split = self._reasoning.feed(text)
        return _reasoning_delta(split.reasoning) + self._content(split.content, final=False)

    def finish(self) -> list[dict[str, Any]]:
        if not self.parses:
            return []
        if self._reasoning is None:
            return self._content("", final=True)
        split = self._reasoning.finish()
        return _reasoning_delta(split.reasoning) + self._content(split.content, final=True)

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """ "tool_calls" when the model stopped after calling (a cut-off stays "length")."""
        called = self._calls is not None and bool(self._calls.result().tool_calls)
        return "tool_calls" if called and engine_reason == "stop" else engine_reason

    def message(self) -> dict[str, Any]:
        """The whole message (after `finish`): content None when there was only a call."""
        message: dict[str, Any] = {"role": "assistant"}
        if self._calls is not None:
            parsed = self._calls.result()
            message["content"] = parsed.content
            if self._reasoning is not None:
                _add_reasoning(message, self._reasoning.result().reasoning)
            if parsed.tool_calls:
                message["tool_calls"] = [
                    {"id": call.id, "type": "custom",
                     "custom": {"name": call.name, "input": input_of(call.arguments_json)}}
                    if call.name in self._custom else
                    {"id": call.id, "type": "function",
                     "function": {"name": call.name, "arguments": call.arguments_json}}
                    for call in parsed.tool_calls
                ]  # fmt: skip
            return message
        if self._reasoning is not None:
            result = self._reasoning.result()
            message["content"] = result.content
            _add_reasoning(message, result.reasoning)
            return message
        message["content"] = "".join(self._text)
        return message

    def _content(self, text: str, final: bool) -> list[dict[str, Any]]:
        if self._calls is None:
            return [{"content": text}] if text else []
        events = self._calls.feed(text) if text else []
        if final:
            events += self._calls.finish()
        deltas = _tool_deltas(events)
        return self._as_custom(deltas) if self._custom else deltas

    def _as_custom(self, deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Chat's custom tools' calls in their own delta shape (``{"index", "id", "type":
        "custom", "custom": {"name", "input"}}``), the input decoded from the arguments' JSON as
        it streams. Only the chat API has custom tools here (the agents' APIs keep their calls
        as functions and shape them themselves)."""
        out = []
        for delta in deltas:
            call = delta.get("tool_calls", [{}])[0]
            index, function = call.get("index"), call.get("function", {})
            if "name" in function and function["name"] in self._custom:
                self._inputs[index] = InputStream()
                custom = {"name": function["name"], "input": ""}
                out.append({"tool_calls": [{"index": index, "id": call["id"], "type": "custom",
                                            "custom": custom}]})  # fmt: skip
            elif index in self._inputs and "arguments" in function:
                text = self._inputs[index].feed(function["arguments"])
                if text:
                    out.append({"tool_calls": [{"index": index, "custom": {"input": text}}]})
            else:
                out.append(delta)
        return out


def _add_reasoning(message: dict[str, Any], reasoning: str | None) -> None:
    message["reasoning_content"] = reasoning
    message["reasoning"] = reasoning


def _reasoning_delta(text: str) -> list[dict[str, Any]]:
    return [{"reasoning_content": text, "reasoning": text}] if text else []


def _tool_deltas(events: list[ToolEvent]) -> list[dict[str, Any]]:
    """Parser events as OpenAI deltas; consecutive content merges into one."""
    deltas: list[dict[str, Any]] = []
    for event in events:
        if isinstance(event, ContentDelta):
            if event.text and deltas and set(deltas[-1]) == {"content"}:
                deltas[-1]["content"] += event.text
            elif event.text:
                deltas.append({"content": event.text})
        elif isinstance(event, ToolCallStart):
            call = {
                "index": event.index,
                "id": event.id,
                "type": "function",
                "function": {"name": event.name, "arguments": ""},
            }
            deltas.append({"tool_calls": [call]})
        elif isinstance(event, ToolCallArguments):
            fragment = {"index": event.index, "function": {"arguments": event.fragment}}
            deltas.append({"tool_calls": [fragment]})
    return deltas
