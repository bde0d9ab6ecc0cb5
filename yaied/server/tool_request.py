"""The tool-calling fields of a chat request: ``tools``, ``tool_choice``, ``parallel_tool_calls``,
and the messages that carry earlier calls (assistant ``tool_calls``) and their results (``tool``
messages). Pure parsing, as protocol.py: shapes and types checked, every fault a 400 naming the
field as the client spelled it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

from yaied.core.grammar_spec import GrammarSpec, StructuredOutputError, make_spec
from yaied.server.errors import APIError
from yaied.tools.custom import arguments_of, input_parameters, json_string_regex
from yaied.tools.grammar import NO_PARAMETERS, Tool, ToolChoice

# OpenAI caps a request at 128 tools; a bigger list is a prompt no model follows anyway.
MAX_TOOLS = 128
# OpenAI's rule (letters, digits, _ and -, at most 64) plus dots, which MCP tool names use.
_TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_CHOICE_MODES = ("none", "auto", "required")
# Chat's names for a tool's schema and a custom tool's format ("{i}": the tool's index).
SCHEMA_FIELD = "tools[{i}].function.parameters"
FORMAT_FIELD = "tools[{i}].custom.format"


@dataclass(slots=True)
class ToolRequest:
    """What a chat request asks of tool calling. `active`: the output is parsed for calls."""

    tools: list[Tool] = field(default_factory=list)
    choice: ToolChoice = field(default_factory=lambda: ToolChoice("none"))
    parallel: bool = True
    # chat's custom tools ({"type": "custom"}): their calls are written back in that shape
    custom: frozenset[str] = frozenset()
    # the start of the ids of the calls the model makes: OpenAI's, or Anthropic's "toolu_"
    call_id_prefix: str = "call_"
    # The API's names for a tool's schema and a custom tool's format ("{i}": the tool's index)
    schema_field: str = SCHEMA_FIELD
    format_field: str = FORMAT_FIELD

    @property
    def active(self) -> bool:
        return bool(self.tools) and self.choice.mode != "none"

    def definitions(self) -> list[dict[str, Any]]:
        return [tool.definition() for tool in self.tools]

    def argument_specs(self) -> list[tuple[str, GrammarSpec]]:
        """Each tool's name and what its arguments are held to on their own (its schema, a custom
        tool's regex), named by the API's field: to tell which tool is at fault when the
        output's grammar, which holds them all, does not compile."""
        specs = []
        for i, tool in enumerate(self.tools):
            if tool.input_regex is not None:
                spec = GrammarSpec("regex", tool.input_regex, self.format_field.format(i=i))
            else:  # parsed already: make_spec passes
                spec = make_spec("json_schema", tool.parameters, self.schema_field.format(i=i))
            specs.append((tool.name, spec))
        return specs


def parse_tool_request(
    body: dict[str, Any], schema_field: str = SCHEMA_FIELD, format_field: str = FORMAT_FIELD
) -> ToolRequest:
    """``schema_field``, ``format_field``: the API's names (ToolRequest's), where not chat's."""
    for name in ("functions", "function_call"):
        if body.get(name) is not None:
            raise APIError(
                400,
                f"{name} is OpenAI's deprecated functions API; send tools and tool_choice",
                param=name,
            )
    tools = _parse_tools(body.get("tools"), schema_field)
    choice = _parse_choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is None:
        parallel = True
    elif not isinstance(parallel, bool):
        raise APIError(400, "parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    custom = frozenset(tool.name for tool in tools if tool.free_form)
    return ToolRequest(
        tools, choice, parallel, custom, schema_field=schema_field, format_field=format_field
    )


def _parse_tools(value: Any, schema_field: str) -> list[Tool]:
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
        kind = item.get("type", "function")
        if kind == "custom":
            tools.append(_parse_custom(item.get("custom"), f"{where}.custom"))
            continue
        if kind != "function":
            text = f"{where}.type must be 'function' or 'custom'"
            raise APIError(400, text, param=f"{where}.type")
        function = item.get("function")
        if not isinstance(function, dict):
            raise APIError(400, f"{where}.function must be an object", param=f"{where}.function")
        tools.append(_parse_function(function, f"{where}.function", schema_field.format(i=i)))
    names = [tool.name for tool in tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            where = f"tools[{i}].function.name"
            raise APIError(400, f"two tools are named {name!r}", param=where)
    return tools


def _parse_function(function: dict[str, Any], where: str, schema_param: str = "") -> Tool:
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
        make_spec("json_schema", parameters, schema_param or f"{where}.parameters")
    except StructuredOutputError as exc:
        raise APIError(400, exc.message, param=exc.param) from None
    return Tool(name, description, parameters, strict)


def _parse_custom(custom: Any, where: str) -> Tool:
    """Chat's custom tool (``{"name", "description", "format"}``, the format's grammar nested
    as ``{"type": "grammar", "grammar": {"syntax", "definition"}}``) as a function of one
    string (tools/custom.py), its regex enforced over the JSON-escaped input."""
    if not isinstance(custom, dict):
        raise APIError(400, f"{where} must be an object", param=where)
    fmt = custom.get("format", {"type": "text"})
    grammar = fmt.get("grammar") if isinstance(fmt, dict) else None
    if isinstance(grammar, dict):
        fmt = {"type": fmt.get("type"), **grammar}
    function, regex = custom_function(custom, fmt, where)
    tool = _parse_function(function, where)
    return replace(tool, input_regex=regex, free_form=True)


def custom_function(
    tool: dict[str, Any], fmt: Any, where: str
) -> tuple[dict[str, Any], str | None]:
    """A custom tool (name, description; its format: ``{"type": "text"}`` or ``{"type":
    "grammar", "syntax", "definition"}``) as the function the model sees, and its input's
    JSON-escaped regex. Lark grammars are refused: xgrammar reads EBNF, and the grammar would
    have to hold inside a JSON string."""
    description = tool.get("description")
    if description is not None and not isinstance(description, str):
        raise APIError(400, f"{where}.description must be a string", f"{where}.description")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    regex = note = None
    if kind == "grammar":
        syntax, definition = fmt.get("syntax"), fmt.get("definition")
        if syntax == "lark":
            text = f"{where}.format: lark grammars are not supported here; send a regex or text"
            raise APIError(400, text, param=f"{where}.format")
        if syntax != "regex" or not isinstance(definition, str):
            text = f"{where}.format: a grammar is {{syntax: regex, definition: <a string>}}"
            raise APIError(400, text, param=f"{where}.format")
        try:
            regex = json_string_regex(definition)
        except ValueError as exc:
            raise APIError(400, f"{where}.format.definition: {exc}", f"{where}.format") from None
        note = f"The input matches the regular expression {definition}"
    elif kind != "text":
        text = f"{where}.format.type must be text or grammar"
        raise APIError(400, text, param=f"{where}.format")
    function = {"name": tool.get("name"), "parameters": input_parameters(note)}
    if description:
        function["description"] = description
    return function, regex


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
        kind = value.get("type")
        named = value.get(kind) if kind in ("function", "custom") else None
        name = named.get("name") if isinstance(named, dict) else None
        if not isinstance(name, str):
            raise APIError(
                400,
                'a named tool_choice is {"type": "function", "function": {"name": ...}} (or '
                "custom)",
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
        custom = call.get("custom") if isinstance(call, dict) else None
        if isinstance(custom, dict) and isinstance(custom.get("input"), str):
            # a custom tool's earlier call, as the function of one string the model made
            call = {**call, "function": {"name": custom.get("name"),
                                         "arguments": arguments_of(custom["input"])}}  # fmt: skip
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
