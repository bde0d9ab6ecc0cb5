"""Anthropic Messages API request parsing: a ``POST /v1/messages`` body to a chat ParsedRequest.

Pure functions, as protocol.py (the 400s are rewritten into Anthropic's shape on the way out,
server/error_shape.py). Content blocks become chat messages:

    user:      text -> content; tool_result {tool_use_id, content} -> a "tool" message
    assistant: text -> content; tool_use {id, name, input} -> tool_calls (input as JSON text);
               thinking / redacted_thinking -> dropped (as templates drop earlier thinking)

Consecutive messages of one role are one turn, and tool uses and results must pair up turn
by turn, as Anthropic has it (messages_turns.py). A last message from the assistant is a
prefill: the answer continues it (``_prefill``). ``system`` is the system message; a
``role: "system"`` message later on is another, where it stands (messages_turns.py).
``max_tokens`` is required, as Anthropic requires it. Sampling fields come from the one table
(core/sampling_fields.py, endpoint "messages"): max_tokens,
temperature, top_p, top_k, stop_sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from yaied.core.grammar_spec import GrammarSpec, StructuredOutputError, make_spec
from yaied.core.request import MAX_STOP_STRINGS
from yaied.core.sampling_fields import request_names
from yaied.server.chat_messages import parse_messages
from yaied.server.chat_protocol import check_continuation
from yaied.server.context_edits import Edit, parse_context_management
from yaied.server.errors import APIError
from yaied.server.messages_turns import check_tool_pairs, turns
from yaied.server.protocol import (
    ParsedRequest,
    _get,
    _refuse_unknown_fields,
    parse_sampling,
)
from yaied.server.tool_request import ToolRequest, parse_tool_request

# Fields that cannot change the output here: type-checked, then ignored. cache_control: the
# prefix cache keeps every prompt's pages without being asked.
_NO_OPS: dict[str, tuple[type, ...]] = {
    "cache_control": (dict,),
    "service_tier": (str,),
    "inference_geo": (str,),
    "speed": (str,),
    "workspace_id": (str,),
    "user_profile_id": (str,),
}
MESSAGES_FIELDS = frozenset(
    {
        *request_names("messages"),
        *("model", "messages", "system", "tools", "tool_choice", "thinking", "stream"),
        *("metadata", "output_config", "container", "mcp_servers", "diagnostics"),
        "context_management",
        *_NO_OPS,
    }
)
# count_tokens: what shapes the prompt, and what the client's count_tokens also sends
COUNT_TOKENS_FIELDS = frozenset(
    {"model", "messages", "system", "tools", "tool_choice", "thinking", "context_management"}
    | {"output_config", *_NO_OPS}
)
_UNSUPPORTED = {
    "container": "containers",
    "mcp_servers": "MCP servers",
    "diagnostics": "diagnostics",
}
_EFFORTS = ("low", "medium", "high", "xhigh", "max")
# Anthropic's thinking types: on (enabled, adaptive, between_tools: all "the model thinks"
# here) or off
_THINKING = ("enabled", "adaptive", "between_tools", "disabled")
_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
_MIN_THINKING_BUDGET = 1024  # Anthropic's least budget_tokens


def _is_budget(value: Any) -> bool:
    ok = isinstance(value, int) and not isinstance(value, bool)
    return ok and value >= _MIN_THINKING_BUDGET


@dataclass(slots=True)
class MessagesRequest:
    parsed: ParsedRequest
    stop_sequences: tuple[str, ...] = ()
    omit_thinking: bool = False  # thinking.display "omitted": blocks with their text left out
    context_edits: list[Edit] = field(default_factory=list)  # context_management (its module)


def parse_anthropic(body: dict[str, Any], *, count_only: bool = False) -> MessagesRequest:
    _refuse_unknown_fields(body, COUNT_TOKENS_FIELDS if count_only else MESSAGES_FIELDS)
    for name, what in _UNSUPPORTED.items():
        if body.get(name) is not None:
            raise APIError(400, f"{what} are not supported", param=name)
    parsed = ParsedRequest("chat", _get(body, "model", (str,)))
    for name, kinds in _NO_OPS.items():
        _get(body, name, kinds)
    parsed.structured = _output_format(body)  # count_tokens: checked, the prompt unchanged
    if not count_only:
        if body.get("max_tokens") is None:
            raise APIError(400, "max_tokens is required", param="max_tokens")
        parsed.stream = _get(body, "stream", (bool,), False)
        metadata = _get(body, "metadata", (dict,), {})
        user = {"metadata.user_id": metadata.get("user_id")}  # named as the client sent it
        parsed.user = _get(user, "metadata.user_id", (str,))
        parse_sampling(body, parsed, "messages")
        parsed.max_tokens_to_context = True
        _stop_sequences(body.get("stop_sequences"))
    system = _system(body.get("system"))
    parsed.messages = parse_messages(system + _messages(body.get("messages")))
    parsed.tools = _tools(body)
    if body["messages"][-1]["role"] == "assistant":
        _prefill(parsed)
    out = MessagesRequest(parsed, tuple(parsed.sampling.get("stop") or ()))
    out.context_edits = parse_context_management(body)
    thinking = _get(body, "thinking", (dict,))
    if thinking is not None:
        kind = thinking.get("type")
        if kind not in _THINKING:
            text = f"thinking.type must be one of {', '.join(_THINKING)}"
            raise APIError(400, text, "thinking.type")
        budget = thinking.get("budget_tokens")
        if (budget is not None or kind == "enabled") and not _is_budget(budget):
            # Anthropic's bounds; over max_tokens is allowed (interleaved thinking goes past it)
            text = f"thinking.budget_tokens must be an integer >= {_MIN_THINKING_BUDGET}"
            raise APIError(400, text, "thinking.budget_tokens")
        display = thinking.get("display")
        if display not in (None, "summarized", "omitted"):
            raise APIError(400, "thinking.display must be summarized or omitted", "thinking")
        # Templates that switch thinking (Qwen3's) read enable_thinking; others ignore it. The
        # model decides how long it thinks whatever the type (a budget is not enforced).
        parsed.chat_template_kwargs = {"enable_thinking": kind != "disabled"}
        out.omit_thinking = display == "omitted"
    return out


def _stop_sequences(value: Any) -> None:
    """Refused in the Messages API's own words (the engine's checks name chat's ``stop``)."""
    if value is None:
        return
    if isinstance(value, str):  # the table's stop takes one string; Anthropic does not
        raise APIError(400, "stop_sequences must be a list of strings", "stop_sequences")
    if not all(value):
        raise APIError(400, "stop_sequences must be non-empty strings", "stop_sequences")
    if len(value) > MAX_STOP_STRINGS:
        text = f"stop_sequences may hold at most {MAX_STOP_STRINGS} strings, got {len(value)}"
        raise APIError(400, text, "stop_sequences")


def _prefill(parsed: ParsedRequest) -> None:
    """A last message from the assistant is a prefill, as Anthropic's API has it: the answer
    continues its text (and holds only what follows it). Anthropic refuses trailing whitespace
    there, which would leave the model to start a word after a space token."""
    text = parsed.messages[-1].get("content") or ""
    if text != text.rstrip():
        raise APIError(
            400, "final assistant content cannot end with trailing whitespace", param="messages"
        )
    parsed.continue_final_message, parsed.add_generation_prompt = True, False
    check_continuation(parsed, "messages")


def _system(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": "system", "content": value}]
    if isinstance(value, list):
        return [{"role": "system", "content": _texts(value, "system")}]
    raise APIError(400, "system must be a string or a list of text blocks", param="system")


def _texts(blocks: list[Any], where: str) -> str:
    texts = []
    for j, block in enumerate(blocks):
        kind = _kind(block, f"{where}[{j}]")
        if kind != "text":
            raise _unread(kind, f"{where}[{j}]", f"{where}[{j}] must be a text block")
        if not isinstance(block.get("text"), str):
            raise APIError(400, f"{where}[{j}].text must be a string", param=where)
        texts.append(block["text"])
    return "\n".join(texts)


def _messages(value: Any) -> list[dict[str, Any]]:
    """The client's messages as chat messages: one role's run is one turn (messages_turns.py),
    each turn's blocks read in order, then the tool uses and results checked to pair up."""
    conversation = turns(value)
    out: list[dict[str, Any]] = []
    for turn in conversation:
        out += _blocks(turn.role, turn.blocks)
    check_tool_pairs(conversation)
    return out


def _blocks(role: str, blocks: list[tuple[str, Any]]) -> list[dict[str, Any]]:
    """One turn's blocks (with their positions) as chat messages: tool results first (each its
    own "tool" message), then the text and calls as one message of the role."""
    results: list[dict[str, Any]] = []
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for at, block in blocks:
        kind = _kind(block, at)
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise APIError(400, f"{at}.text must be a string", param=at)
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_use(block, at))
        elif kind == "tool_result" and role == "user":
            results.append(_tool_result(block, at))
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue
        elif kind == "document" and role == "user":
            texts.append(_document(block, at))
        else:
            raise _unread(kind, at, f"{at}: a {role} message cannot hold a {kind!r} block")
    out = list(results)
    if texts or calls or not results:
        item: dict[str, Any] = {"role": role, "content": "\n".join(texts)}
        if calls:
            item["tool_calls"] = calls
        out.append(item)
    return out


# the blocks read here (somewhere): any other kind is one the model cannot read (_unread)
_READ = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking", "document")


def _kind(block: Any, at: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise APIError(400, f"{at} must be an object with a type (a content block)", param=at)
    return block["type"]


def _unread(kind: str, at: str, misplaced: str) -> APIError:
    """The 400 for a block of ``kind`` where it cannot be: ``misplaced`` for a kind read
    elsewhere, else one saying that kind is not supported (images: the model reads text)."""
    if kind in _READ:
        return APIError(400, misplaced, param=at)
    why = " (the model reads text only)" if kind == "image" else ""
    return APIError(400, f"{at}: {kind} blocks are not supported{why}", param=at)


def _document(block: dict[str, Any], at: str) -> str:
    """A document block whose source is text (``{"type": "text", "data"}``, or ``content``: a
    string or text blocks) as the text it holds, after its title and context; PDFs and
    images (base64, url, file sources) are a 400: the model reads text."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "text" and isinstance(source.get("data"), str):
        text = source["data"]
    elif kind == "content" and isinstance(source.get("content"), str):
        text = source["content"]
    elif kind == "content" and isinstance(source.get("content"), list):
        text = _texts(source["content"], f"{at}.source.content")
    else:
        text_ = f"{at}: document blocks with a {kind!r} source are not supported (send text)"
        raise APIError(400, text_, param=f"{at}.source")
    parts = [block.get(name) for name in ("title", "context")]
    if not all(part is None or isinstance(part, str) for part in parts):
        raise APIError(400, f"{at}: a document's title and context are strings", param=at)
    return "\n\n".join(part for part in [*parts, text] if part)


def _tool_use(block: dict[str, Any], at: str) -> dict[str, Any]:
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input")
    if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(arguments, dict):
        raise APIError(400, f"{at}: tool_use needs id, name (strings) and input (an object)", at)
    text = orjson.dumps(arguments).decode()
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": text}}


def _tool_result(block: dict[str, Any], at: str) -> dict[str, Any]:
    call_id, content = block.get("tool_use_id"), block.get("content", "")
    if not isinstance(call_id, str):
        raise APIError(400, f"{at}.tool_use_id is required (a string)", param=at)
    if isinstance(content, list):
        content = _texts(content, f"{at}.content")
    elif not isinstance(content, str):
        raise APIError(400, f"{at}.content must be a string or text blocks", param=at)
    if block.get("is_error") is True:
        content = f"Error: {content}"
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def _tools(body: dict[str, Any]) -> ToolRequest:
    """Anthropic's tools (``{name, description, input_schema}``) and tool_choice in chat's shape,
    through chat's parser (the same names, schemas and bounds)."""
    tools = _get(body, "tools", (list,), [])
    chat_tools = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
            raise APIError(400, f"tools[{i}]: only custom (client) tools are supported", "tools")
        function = {"name": tool.get("name"), "parameters": tool.get("input_schema")}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        if not isinstance(function["name"], str):
            raise APIError(400, f"tools[{i}].name is required (a string)", f"tools[{i}].name")
        if not isinstance(function["parameters"], dict):
            text = f"tools[{i}].input_schema is required (a JSON schema object)"
            raise APIError(400, text, f"tools[{i}].input_schema")
        chat_tools.append({"type": "function", "function": function})
    choice = _get(body, "tool_choice", (dict,))
    chat_choice: Any = None
    parallel = None
    if choice is not None:
        kind = choice.get("type")
        if kind == "tool":
            if not isinstance(choice.get("name"), str):
                raise APIError(400, "tool_choice of type tool needs a name", "tool_choice")
            chat_choice = {"type": "function", "function": {"name": choice["name"]}}
        elif kind in _CHOICES:
            chat_choice = _CHOICES[kind]
        else:
            raise APIError(400, "tool_choice.type must be auto, any, tool or none", "tool_choice")
        if choice.get("disable_parallel_tool_use") is True:
            parallel = False
    chat_body = {"tools": chat_tools or None, "tool_choice": chat_choice}
    chat_body["parallel_tool_calls"] = parallel
    request = parse_tool_request(chat_body, schema_field="tools[{i}].input_schema")
    return replace(request, call_id_prefix="toolu_")  # Anthropic's tool_use ids


def _output_format(body: dict[str, Any]) -> GrammarSpec | None:
    """``output_config``: ``format`` {"type": "json_schema", "schema"} constrains the output as
    chat's response_format does; ``effort`` is accepted (a template may read it, none needs it)."""
    config = _get(body, "output_config", (dict,), {})
    extra = sorted(set(config) - {"format", "effort"})
    if extra:
        param = f"output_config.{extra[0]}"
        raise APIError(400, f"{param} is not supported", param=param)
    effort = config.get("effort")
    if effort is not None and effort not in _EFFORTS:
        param = "output_config.effort"
        raise APIError(400, f"{param} must be one of {', '.join(_EFFORTS)}", param=param)
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or "schema" not in fmt:
        text = 'output_config.format is {"type": "json_schema", "schema": {...}}'
        raise APIError(400, text, param="output_config.format")
    try:
        return make_spec("json_schema", fmt["schema"], "output_config.format.schema")
    except StructuredOutputError as exc:
        raise APIError(400, exc.message, param=exc.param) from None
