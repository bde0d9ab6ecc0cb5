"""The tools of a ``POST /v1/responses`` body, in chat's terms: Responses' flat function tools
(``{"type": "function", "name", "parameters"}``) and free-form custom tools
(``{"type": "custom", "name", "format"}``), parsed by chat's tool parser (the same names,
schemas and bounds), and custom tools' calls and outputs in the input.

A custom tool is shown to the model as a function with one string parameter (tools/custom.py);
its calls come back as ``custom_tool_call`` items with the decoded ``input`` text. Its format is
text (anything) or a regex grammar, which the call's grammar enforces. Lark grammars are refused:
xgrammar reads EBNF, and a grammar would have to hold inside a JSON string.

A ``namespace`` tool (``{"type": "namespace", "name", "description", "tools"}``, function and
custom tools grouped, as Codex sends its sub-agent tools) gives the model each of its tools as
``<namespace>.<name>``; their calls come back named by the tool's own name with the
``namespace`` beside it, as OpenAI writes them, and calls sent back so are read the same way.
OpenAI's hosted web search (``web_search``, ``web_search_preview``), which Codex sends with
every request, is accepted and never offered to the model: yaied runs no hosted tools, so the
model answers as one that chose not to search (forcing it with ``tool_choice`` is a 400).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from yaied.server.errors import APIError
from yaied.server.protocol import ParsedRequest, _get
from yaied.server.tool_request import custom_function, parse_tool_request
from yaied.tools.custom import arguments_of

# OpenAI's hosted web search, which yaied does not run (module docstring)
_NOT_RUN = ("web_search", "web_search_preview", "web_search_2025_08_26")
_NOT_RUN_PREFIXES = ("web_search_preview_",)
# A model-visible tool name -> (namespace, the tool's own name)
Namespaced = dict[str, tuple[str, str]]


@dataclasses.dataclass(slots=True)
class ResponsesTools:
    """The tools and tool_choice as the client sent them (the response echoes them), the
    names of the custom tools and of the namespaced ones (``Namespaced``)."""

    tools: list[Any]
    choice: Any
    custom: frozenset[str]
    namespaced: Namespaced


def _flat(tools: list[Any]) -> tuple[list[tuple[str, dict[str, Any]]], Namespaced]:
    """Each function and custom tool with where the client put it, a namespace's under their
    qualified names; hosted tools that are not run left out."""
    out: list[tuple[str, dict[str, Any]]] = []
    namespaced: Namespaced = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind in _NOT_RUN or (isinstance(kind, str) and kind.startswith(_NOT_RUN_PREFIXES)):
            continue
        if kind != "namespace":
            out.append((where, tool))
            continue
        name, inner = tool.get("name"), tool.get("tools")
        if not isinstance(name, str) or not isinstance(inner, list) or not inner:
            text = f"{where}: a namespace tool needs a name and tools (a non-empty list)"
            raise APIError(400, text, param=where)
        for j, member in enumerate(inner):
            at = f"{where}.tools[{j}]"
            if not isinstance(member, dict) or member.get("type") not in ("function", "custom"):
                raise APIError(400, f"{at}: a namespace holds function and custom tools", at)
            own = member.get("name")
            if not isinstance(own, str):
                raise APIError(400, f"{at}.name is required (a string)", param=f"{at}.name")
            namespaced[f"{name}.{own}"] = (name, own)
            out.append((at, {**member, "name": f"{name}.{own}"}))
    return out, namespaced


def parse_tools(body: dict[str, Any], parsed: ParsedRequest) -> ResponsesTools:
    """Sets ``parsed.tools``; returns the request's tools (ResponsesTools)."""
    tools = _get(body, "tools", (list,), [])
    flat, namespaced = _flat(tools)
    chat_tools, regexes = [], {}
    for where, tool in flat:
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function":
            function = {k: v for k, v in tool.items() if k != "type"}
        elif kind == "custom":
            fmt = tool.get("format", {"type": "text"})
            function, regexes[tool.get("name")] = custom_function(tool, fmt, where)
        else:
            text = f"{where}: only function, custom and namespace tools are supported, got {kind!r}"
            raise APIError(400, text, param=where)
        chat_tools.append({"type": "function", "function": function})
    choice = body.get("tool_choice")
    # "auto" with nothing to offer the model (Codex's compaction turn sends tools: [], or only
    # the hosted search) is no tools, as OpenAI takes it; "required" stays a 400
    chat_choice = None if choice == "auto" and not chat_tools else choice
    if isinstance(choice, dict):
        if choice.get("type") not in ("function", "custom") or not isinstance(
            choice.get("name"), str
        ):
            text = 'a named tool_choice is {"type": "function" or "custom", "name": ...}'
            raise APIError(400, text, param="tool_choice")
        chat_choice = {"type": "function", "function": {"name": choice["name"]}}
    chat_body = {"tools": chat_tools or None, "tool_choice": chat_choice}
    chat_body["parallel_tool_calls"] = body.get("parallel_tool_calls")
    try:
        parsed.tools = parse_tool_request(chat_body, "tools[{i}].parameters", "tools[{i}].format")
    except APIError as exc:  # chat's names for the fields: tools[i].function.name -> tools[i].name
        exc.param = exc.param and _client_names(exc.param, flat)
        exc.message = _client_names(exc.message, flat)
        raise
    parsed.tools.tools = [
        dataclasses.replace(t, input_regex=regexes[t.name]) if regexes.get(t.name) else t
        for t in parsed.tools.tools
    ]
    default_choice = "auto" if tools else "none"
    chosen = choice if choice is not None else default_choice
    return ResponsesTools(tools, chosen, frozenset(regexes), namespaced)


def _client_names(text: str, flat: list[tuple[str, dict[str, Any]]]) -> str:
    """Chat's ``tools[k].function.x`` as where the client put that tool (``tools[i].x``, or
    ``tools[i].tools[j].x`` in a namespace)."""
    text = text.replace(".function", "")
    return re.sub(r"tools\[(\d+)\]", lambda m: flat[int(m[1])][0], text)


def qualified(item: dict[str, Any], where: str) -> str | None:
    """The name the model knows an earlier call's tool by: ``<namespace>.<name>`` when the
    item names its namespace."""
    name, namespace = item.get("name"), item.get("namespace")
    if namespace is None or not isinstance(name, str):
        return name
    if not isinstance(namespace, str):
        raise APIError(400, f"{where}.namespace must be a string", param=f"{where}.namespace")
    return f"{namespace}.{name}"


def custom_call_as_function(item: dict[str, Any], where: str) -> dict[str, Any]:
    """An earlier ``custom_tool_call`` input item as the function call the model made."""
    call_id, name, text = item.get("call_id"), item.get("name"), item.get("input")
    if not all(isinstance(v, str) for v in (call_id, name, text)):
        raise APIError(400, f"{where} needs call_id, name and input (strings)", where)
    return {"call_id": call_id, "name": name, "arguments": arguments_of(text)}
