"""The tools of a ``POST /v1/responses`` body, in chat's terms: Responses' flat function tools
(``{"type": "function", "name", "parameters"}``) and free-form custom tools
(``{"type": "custom", "name", "format"}``), parsed by chat's tool parser (the same names,
schemas and bounds), and custom tools' calls and outputs in the input.

A custom tool is shown to the model as a function with one string parameter (tools/custom.py);
its calls come back as ``custom_tool_call`` items with the decoded ``input`` text. Its format is
text (anything) or a regex grammar, which the call's grammar enforces. Lark grammars are refused:
xgrammar reads EBNF, and a grammar would have to hold inside a JSON string.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from yaied.server.errors import APIError
from yaied.server.protocol import ParsedRequest, _get
from yaied.server.tool_request import custom_function, parse_tool_request
from yaied.tools.custom import arguments_of


def parse_tools(body: dict[str, Any], parsed: ParsedRequest) -> tuple[list, Any, frozenset[str]]:
    """Sets ``parsed.tools``; returns the tools and tool_choice as the client sent them (the
    response echoes them) and the names of the custom tools."""
    tools = _get(body, "tools", (list,), [])
    chat_tools, regexes = [], {}
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function":
            function = {k: v for k, v in tool.items() if k != "type"}
        elif kind == "custom":
            fmt = tool.get("format", {"type": "text"})
            function, regexes[tool.get("name")] = custom_function(tool, fmt, f"tools[{i}]")
        else:
            text = f"tools[{i}]: only function and custom tools are supported, got {kind!r}"
            raise APIError(400, text, param=f"tools[{i}]")
        chat_tools.append({"type": "function", "function": function})
    choice = body.get("tool_choice")
    chat_choice = choice
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
        exc.param = exc.param and exc.param.replace(".function", "")
        exc.message = exc.message.replace(".function", "")
        raise
    parsed.tools.tools = [
        dataclasses.replace(t, input_regex=regexes[t.name]) if regexes.get(t.name) else t
        for t in parsed.tools.tools
    ]
    default_choice = "auto" if tools else "none"
    return tools, choice if choice is not None else default_choice, frozenset(regexes)


def custom_call_as_function(item: dict[str, Any], where: str) -> dict[str, Any]:
    """An earlier ``custom_tool_call`` input item as the function call the model made."""
    call_id, name, text = item.get("call_id"), item.get("name"), item.get("input")
    if not all(isinstance(v, str) for v in (call_id, name, text)):
        raise APIError(400, f"{where} needs call_id, name and input (strings)", where)
    return {"call_id": call_id, "name": name, "arguments": arguments_of(text)}
