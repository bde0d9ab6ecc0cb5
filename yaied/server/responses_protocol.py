"""OpenAI Responses API request parsing: a ``POST /v1/responses`` body to a chat ParsedRequest.

Pure functions, as protocol.py: shapes and JSON types checked, every fault a 400 naming the field
as the client spelled it, unknown fields refused. The input items become chat messages:

    {"role": ..., "content": str | [input_text | output_text parts]}  -> that message
    {"type": "function_call", call_id, name, arguments}               -> assistant tool_calls
    {"type": "function_call_output", call_id, output}                 -> a "tool" message
    {"type": "custom_tool_call", call_id, name, input}                -> as a function_call
    {"type": "custom_tool_call_output", call_id, output}              -> a "tool" message
    {"type": "reasoning", ...}                                        -> dropped (as templates
                                                                          drop earlier thinking)
    {"type": "item_reference", id} (or just {id})                     -> the stored item it names

A ``conversation`` (conversations_api.py) puts its stored items before this input, parsed the
same way (``parse_items``).

Each item is also kept in Responses' own shape (``input_items``), what
``GET /v1/responses/{id}/input_items`` lists. A reference is resolved by the caller's
``resolve`` (the store, in the caller's key namespace); without one, nothing is stored.

``instructions`` is a system message in front of this turn only (OpenAI does not carry it over
a ``previous_response_id``); the stored conversation never holds it. Sampling fields come from
the one table (core/sampling_fields.py, endpoint "responses").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from yaied.core.grammar_spec import GrammarSpec, StructuredOutputError, make_spec
from yaied.core.sampling_fields import request_names
from yaied.server.chat_messages import join_text_parts, parse_messages
from yaied.server.chat_protocol import REASONING_EFFORTS
from yaied.server.errors import APIError
from yaied.server.protocol import (
    ParsedRequest,
    _get,
    _refuse_unknown_fields,
    parse_sampling,
)
from yaied.server.responses_tools import (
    Namespaced,
    custom_call_as_function,
    parse_tools,
    qualified,
)

RESPONSES_FIELDS = frozenset(
    {
        *request_names("responses"),
        *("model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls"),
        *("text", "reasoning", "metadata", "store", "previous_response_id", "stream", "user"),
        *("include", "truncation", "service_tier", "prompt_cache_key", "safety_identifier"),
        *("background", "conversation", "max_tool_calls", "stream_options"),
        *("prompt_cache_retention", "prompt_cache_options", "prompt", "moderation"),
        *("context_management", "image", "access_programs", "background_options"),
        "client_metadata",
    }
)
_UNSUPPORTED = {
    "background_options": "background_options",
    "prompt": "stored prompt templates (send instructions and input)",
    "moderation": "moderation",
    "context_management": "context management (compaction)",
    "image": "image options",
    "access_programs": "access programs",
}
_TEXT_PARTS = ("input_text", "output_text", "text")
# An item id to the stored item it names (a copy), or None.
ItemResolver = Callable[[str], dict[str, Any] | None]
_ROLES = ("user", "assistant", "system", "developer")


@dataclass(slots=True)
class ResponsesRequest:
    """What the response object echoes back, beside the chat request it runs as."""

    parsed: ParsedRequest
    new_messages: list[dict[str, Any]]  # this turn's input, as chat messages
    # the same input as Responses items (references resolved; ids where the client gave them)
    input_items: list[dict[str, Any]] = field(default_factory=list)
    instructions: str | None = None
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    tools: list[dict[str, Any]] = field(default_factory=list)  # as the client sent them
    tool_choice: Any = "auto"
    custom_tools: frozenset[str] = frozenset()  # their calls are custom_tool_call items
    namespaced: Namespaced = field(default_factory=dict)  # a namespace's tools (responses_tools)
    text_format: dict[str, Any] = field(default_factory=lambda: {"type": "text"})
    effort: str | None = None
    background: bool = False  # answered at once, run on, polled with GET (needs store)
    conversation_id: str | None = None  # its items come first; this turn's are added to it
    truncation: str = "disabled"  # "auto": the oldest stored turns go when the prompt overflows


def parse_responses(body: dict[str, Any], resolve: ItemResolver | None = None) -> ResponsesRequest:
    _refuse_unknown_fields(body, RESPONSES_FIELDS)
    for name, what in _UNSUPPORTED.items():
        if body.get(name) not in (None, False):
            raise APIError(400, f"{what} is not supported", param=name)
    truncation = _get(body, "truncation", (str,), "disabled")
    if truncation not in ("disabled", "auto"):
        raise APIError(400, 'truncation must be "disabled" or "auto"', param="truncation")
    # hints with nothing to do here: the prefix cache needs no key, breakpoint or lifetime
    for name in ("service_tier", "prompt_cache_key", "safety_identifier", "prompt_cache_retention"):
        _get(body, name, (str,))
    _get(body, "prompt_cache_options", (dict,))
    _get(body, "client_metadata", (dict,))  # a client's own tags (Codex's ids): nothing to do
    # OpenAI bounds calls of its built-in tools by it; yaied runs none (function and custom
    # tools are the client's to run), so there is nothing to count
    if _get(body, "max_tool_calls", (int,), 1) < 1:
        raise APIError(400, "max_tool_calls must be at least 1", param="max_tool_calls")
    parsed = ParsedRequest("chat", _get(body, "model", (str,)))
    parsed.stream = _get(body, "stream", (bool,), False)
    _get(body, "stream_options", (dict,))
    parsed.user = _get(body, "user", (str,))
    parse_sampling(body, parsed, "responses")
    logprobs = _include(body)
    if logprobs or parsed.logprobs is not None:  # top_logprobs alone asks for them too
        parsed.logprobs = parsed.logprobs or 0
    messages, items = _input(body.get("input"), resolve)
    out = ResponsesRequest(parsed, messages, items)
    out.instructions = _get(body, "instructions", (str,))
    out.store = _get(body, "store", (bool,), True)
    out.truncation = truncation
    out.background = _get(body, "background", (bool,), False)
    if out.background and not out.store:
        raise APIError(400, "background responses need store: true", param="background")
    if out.background and parsed.stream:
        text = "background responses are not streamed here: poll GET /v1/responses/{id}"
        raise APIError(400, text, param="stream")
    out.previous_response_id = _get(body, "previous_response_id", (str,))
    out.conversation_id = _conversation(body)
    if out.conversation_id is not None and out.previous_response_id is not None:
        text = "conversation and previous_response_id cannot be used together"
        raise APIError(400, text, param="conversation")
    out.metadata = _metadata(body)
    tools = parse_tools(body, parsed)
    out.tools, out.tool_choice, out.custom_tools = tools.tools, tools.choice, tools.custom
    out.namespaced = tools.namespaced
    if parsed.logprobs is not None and parsed.tools.active:
        text = "logprobs with tools are not supported on /v1/responses"
        raise APIError(400, text, param="include")
    parsed.structured, out.text_format = _text_format(body)
    out.effort = _effort(body)
    if out.effort is not None:  # templates that know it (gpt-oss) read it; others ignore it
        parsed.chat_template_kwargs = {"reasoning_effort": out.effort}
    return out


def _include(body: dict[str, Any]) -> bool:
    """Whether ``include`` asks for the output text's logprobs; its other values ask for
    nothing more (reasoning text is always sent)."""
    include = _get(body, "include", (list,), [])
    if not all(isinstance(value, str) for value in include):
        raise APIError(400, "include is a list of strings", param="include")
    return "message.output_text.logprobs" in include


def _conversation(body: dict[str, Any]) -> str | None:
    value = body.get("conversation")
    # an object must hold its id: {} or {"conversation_id": ...} read as no conversation would
    # run the turn without its history and save it nowhere
    is_object = isinstance(value, dict)
    if is_object:
        value = value.get("id")
    if (value is not None or is_object) and not isinstance(value, str):
        raise APIError(400, "conversation is an id, or {id}", param="conversation")
    return value


def parse_items(
    value: Any, where: str = "input", resolve: ItemResolver | None = None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A list of Responses items (a conversation's, which need not hold a message) as chat
    messages and as items in their stored shape."""
    return _input(value, resolve, where=where, need_message=False)


def _input(
    value: Any, resolve: ItemResolver | None, where: str = "input", need_message: bool = True
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The input as chat messages, and as Responses items."""
    name = where
    if isinstance(value, str):
        item = _with_id(
            {}, {"type": "message", "role": "user", "content": [_text_part("user", value)]}
        )
        return [{"role": "user", "content": value}], [item]
    if not isinstance(value, list) or (need_message and not value):
        raise APIError(400, f"{name} must be a string or a non-empty list of items", name)
    messages: list[dict[str, Any]] = []
    items: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{where} must be an object", param=where)
        if _is_reference(item):
            item = _referenced(item, where, resolve)
        kind = item.get("type", "message")
        if kind == "message":
            message = _message(item, where)
            messages.append(message)
            text = _text_part(item["role"], message["content"])
            items.append(
                _with_id(item, {"type": "message", "role": item["role"], "content": [text]})
            )
        elif kind == "function_call":
            call = _function_call(item, where, messages)
            items.append(_with_id(item, {"type": "function_call", **call}))
        elif kind == "custom_tool_call":
            function = {**custom_call_as_function(item, where), "namespace": item.get("namespace")}
            call = _function_call(function, where, messages)
            shaped = {"type": kind, "call_id": call["call_id"], "name": call["name"]}
            if "namespace" in call:
                shaped["namespace"] = call["namespace"]
            items.append(_with_id(item, {**shaped, "input": item["input"]}))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id, output = item.get("call_id"), _output_text(item.get("output"), where)
            if not isinstance(call_id, str):
                text = f"{where} needs call_id and output (strings)"
                raise APIError(400, text, param=where)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
            items.append(_with_id(item, {"type": kind, "call_id": call_id, "output": output}))
        elif kind == "reasoning":
            items.append(_with_id(item, {k: v for k, v in item.items() if k != "id"}))
        else:
            raise APIError(400, f"{where}: input items of type {kind!r} are not supported", where)
    if need_message and not messages:
        raise APIError(400, f"{name} holds no message", param=name)
    return (parse_messages(messages) if messages else []), items


def check_call_outputs(history: list[dict[str, Any]], new_messages: list[dict[str, Any]]) -> None:
    """OpenAI's rule: a call's output (a "tool" message) answers a call the conversation holds,
    in the stored history or this input; an output nothing called is a 400, never a prompt
    whose tool result answers nothing."""
    called = {
        call["id"]
        for message in (*history, *new_messages)
        for call in message.get("tool_calls") or ()
    }
    for message in new_messages:
        call_id = message.get("tool_call_id")
        if message["role"] == "tool" and call_id not in called:
            text = f"No tool call found for function call output with call_id {call_id}."
            raise APIError(400, text, param="input")


def _is_reference(item: dict[str, Any]) -> bool:
    """``{"type": "item_reference", "id"}``, or a bare ``{"id"}`` (no type, no role)."""
    if item.get("type") == "item_reference":
        return True
    return "id" in item and "type" not in item and "role" not in item


def referenced_ids(body: dict[str, Any]) -> set[str]:
    """The ids the ``input`` of ``body`` names in item references: what its resolver will be
    asked, looked up beforehand where the parse runs off the loop, away from the store."""
    value = body.get("input")
    if not isinstance(value, list):
        return set()
    items = (item for item in value if isinstance(item, dict) and _is_reference(item))
    return {item["id"] for item in items if isinstance(item.get("id"), str)}


def _referenced(item: dict[str, Any], where: str, resolve: ItemResolver | None) -> dict[str, Any]:
    """The stored item an ``item_reference`` (``{"type": "item_reference", "id"}``, or a bare
    ``{"id"}``) names; a 404 where nothing stored has that id for this caller."""
    item_id = item.get("id")
    if not isinstance(item_id, str):
        raise APIError(400, f"{where}.id must be a string (an item reference)", f"{where}.id")
    found = resolve(item_id) if resolve is not None else None
    if found is None or found.get("type") == "item_reference":
        raise APIError(404, f"{where}: no stored item {item_id!r}", where, code="item_not_found")
    return found


def _with_id(item: dict[str, Any], shaped: dict[str, Any]) -> dict[str, Any]:
    """``shaped``, the item as input_items lists it, with the client's id where it sent one."""
    out = {"id": item["id"]} if isinstance(item.get("id"), str) else {}
    return {**out, **shaped, "status": "completed"}


def _text_part(role: str, text: str) -> dict[str, Any]:
    return {"type": "output_text" if role == "assistant" else "input_text", "text": text}


def _output_text(output: Any, where: str) -> str:
    """A function_call_output's output: a string, or a list of text parts (joined)."""
    if isinstance(output, str):
        return output
    if not isinstance(output, list):
        raise APIError(400, f"{where} needs call_id and output (strings)", param=where)
    return join_text_parts(output, f"{where}.output", _TEXT_PARTS)


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role, content = item.get("role"), item.get("content")
    if role not in _ROLES:
        raise APIError(400, f"{where}.role must be one of {', '.join(_ROLES)}", f"{where}.role")
    if isinstance(content, list):
        content = join_text_parts(content, f"{where}.content", _TEXT_PARTS)
    elif not isinstance(content, str):
        raise APIError(400, f"{where}.content must be a string or a list of parts", where)
    return {"role": "system" if role == "developer" else role, "content": content}


def _function_call(
    item: dict[str, Any], where: str, messages: list[dict[str, Any]]
) -> dict[str, str]:
    """An earlier call joins the assistant message before it (calls of one turn are one
    message, as chat writes them); returns its call_id, name and arguments."""
    call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
    if not all(isinstance(v, str) for v in (call_id, name, arguments)):
        raise APIError(400, f"{where} needs call_id, name and arguments (strings)", where)
    function = {"name": qualified(item, where), "arguments": arguments}
    call = {"id": call_id, "type": "function", "function": function}
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    out = {"call_id": call_id, "name": name, "arguments": arguments}
    if item.get("namespace") is not None:
        out["namespace"] = item["namespace"]
    return out


def _metadata(body: dict[str, Any]) -> dict[str, str]:
    metadata = _get(body, "metadata", (dict,), {})
    if len(metadata) > 16 or not all(
        isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
        for k, v in metadata.items()
    ):
        text = "metadata is at most 16 string pairs (keys 64, values 512 characters)"
        raise APIError(400, text, param="metadata")
    return dict(metadata)


def _text_format(body: dict[str, Any]) -> tuple[GrammarSpec | None, dict[str, Any]]:
    text = _get(body, "text", (dict,), {})
    extra = sorted(set(text) - {"format", "verbosity"})
    if extra:
        raise APIError(400, f"text.{extra[0]} is not supported", param=f"text.{extra[0]}")
    fmt = text.get("format")
    fmt = {"type": "text"} if fmt is None else fmt
    if not isinstance(fmt, dict):
        raise APIError(400, "text.format must be an object", param="text.format")
    kind = fmt.get("type")
    try:
        if kind == "text":
            return None, {"type": "text"}
        if kind == "json_object":
            return make_spec("json_object", None, "text.format"), {"type": "json_object"}
        if kind == "json_schema":
            if not isinstance(fmt.get("name"), str) or "schema" not in fmt:
                text_ = "text.format json_schema needs name and schema"
                raise APIError(400, text_, param="text.format")
            return make_spec("json_schema", fmt["schema"], "text.format.schema"), dict(fmt)
    except StructuredOutputError as exc:
        raise APIError(400, exc.message, param=exc.param) from None
    text_ = "text.format.type must be text, json_object or json_schema"
    raise APIError(400, text_, param="text.format.type")


def _effort(body: dict[str, Any]) -> str | None:
    reasoning = _get(body, "reasoning", (dict,), {})
    effort = reasoning.get("effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        text = f"reasoning.effort must be one of {', '.join(REASONING_EFFORTS)}"
        raise APIError(400, text, param="reasoning.effort")
    summary = reasoning.get("summary")
    if summary is not None and summary not in ("auto", "concise", "detailed"):
        text = "reasoning.summary must be auto, concise or detailed"
        raise APIError(400, text, param="reasoning.summary")
    return effort
