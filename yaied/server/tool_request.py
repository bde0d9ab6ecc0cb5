"""The tool-calling fields of a chat request: ``tools``, ``tool_choice``, ``parallel_tool_calls``,
and the messages that carry earlier calls (assistant ``tool_calls``) and their results (``tool``
messages). Pure parsing, as protocol.py: shapes and types checked, every fault a 400 naming the
field as the client spelled it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from yaied.core.grammar_spec import StructuredOutputError, make_spec
from yaied.server.errors import APIError
from yaied.tools.grammar import NO_PARAMETERS, Tool, ToolChoice

# OpenAI caps a request at 128 tools; a bigger list is a prompt no model follows anyway.
MAX_TOOLS = 128
# OpenAI's rule (letters, digits, _ and -, at most 64) plus dots, which MCP tool names use.
_TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_CHOICE_MODES = ("none", "auto", "required")


@dataclass(slots=True)
class ToolRequest:
    """What a chat request asks of tool calling. `active`: the output is parsed for calls."""

    tools: list[Tool] = field(default_factory=list)
    choice: ToolChoice = field(default_factory=lambda: ToolChoice("none"))
    parallel: bool = True

    @property
    def active(self) -> bool:
        return bool(self.tools) and self.choice.mode != "none"

    def definitions(self) -> list[dict[str, Any]]:
        return [tool.definition() for tool in self.tools]


def parse_tool_request(body: dict[str, Any]) -> ToolRequest:
    for name in ("functions", "function_call"):
        if body.get(name) is not None:
            raise APIError(
                400,
                f"{name} is OpenAI's deprecated functions API; send tools and tool_choice",
                param=name,
            )
    tools = _parse_tools(body.get("tools"))
    choice = _parse_choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is None:
        parallel = True
    elif not isinstance(parallel, bool):
        raise APIError(400, "parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    return ToolRequest(tools, choice, parallel)


def _parse_tools(value: Any) -> list[Tool]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise APIError(400, "tools must be a list of tool definitions", param="tools")
    if len(value) > MAX_TOOLS:
        raise APIError(400, f"at most {MAX_TOOLS} tools are allowed, got {len(value)}", "tools")
    tools: list[Tool] = []
    for i, item in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{where} must be an object", param=where)
        if item.get("type", "function") != "function":
            raise APIError(400, f"{where}.type must be 'function'", param=f"{where}.type")
        function = item.get("function")
        if not isinstance(function, dict):
            raise APIError(400, f"{where}.function must be an object", param=f"{where}.function")
        tools.append(_parse_function(function, f"{where}.function"))
    names = [tool.name for tool in tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            where = f"tools[{i}].function.name"
            raise APIError(400, f"two tools are named {name!r}", param=where)
    return tools


def _parse_function(function: dict[str, Any], where: str) -> Tool:
    name = function.get("name")
    if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
        raise APIError(
            400,
            f"{where}.name must be 1 to 64 letters, digits, '_', '-' or '.', got {name!r}",
            param=f"{where}.name",
        )
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise APIError(400, f"{where}.description must be a string", f"{where}.description")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise APIError(400, f"{where}.strict must be a boolean", param=f"{where}.strict")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = dict(NO_PARAMETERS)
    try:  # the same bounds as any schema a request carries (size, depth, valid JSON)
        make_spec("json_schema", parameters, f"{where}.parameters")
    except StructuredOutputError as exc:
        raise APIError(400, exc.message, param=exc.param) from None
    return Tool(name, description, parameters, strict)


def _parse_choice(value: Any, tools: list[Tool]) -> ToolChoice:
    param = "tool_choice"
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(value, str):
        if value not in _CHOICE_MODES:
            modes = ", ".join(_CHOICE_MODES)
            raise APIError(400, f"tool_choice must be one of {modes} or a function", param)
        choice = ToolChoice(value)  # type: ignore[arg-type]
    elif isinstance(value, dict):
        function = value.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if value.get("type") != "function" or not isinstance(name, str):
            raise APIError(
                400,
                'a named tool_choice is {"type": "function", "function": {"name": ...}}',
                param,
            )
        if name not in {tool.name for tool in tools}:
            raise APIError(400, f"tool_choice names {name!r}, which is not in tools", param)
        choice = ToolChoice("required", name)
    else:
        raise APIError(400, "tool_choice must be a string or an object", param)
    if choice.mode != "none" and not tools:
        raise APIError(400, f"tool_choice {choice.mode!r} needs tools", param)
    return choice


def parse_tool_calls_field(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls``, normalised to OpenAI's shape with ``arguments``
    as JSON text (what the client sent; templates get it parsed, see engine/inputs.py)."""
    if not isinstance(calls, list):
        raise APIError(400, f"{where}.tool_calls must be a list", param=f"{where}.tool_calls")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise APIError(400, f"{at} needs function.name (a string)", param=at)
        arguments = function.get("arguments", "")
        if arguments is None:
            arguments = ""
        if not isinstance(arguments, str):
            raise APIError(400, f"{at}.function.arguments must be a string", f"{at}.function")
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise APIError(400, f"{at}.id must be a string", param=f"{at}.id")
        item = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
        if call_id is not None:
            item["id"] = call_id
        out.append(item)
    return out
