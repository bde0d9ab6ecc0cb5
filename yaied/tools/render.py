"""Fallback rendering of tools and tool history for chat templates that cannot do it.

Many chat templates ignore `tools=` and render only `role` and `content`; the embedded default
model's ChatML template even fails on an assistant turn whose content is null (it concatenates
`message['content']`). For those, `render_fallback` rewrites an OpenAI messages list into plain
{role, content} strings the template can render:

- the tools are described in a system message (merged after the client's own system message),
  with the call format, in the words Qwen2.5's template uses for hermes;
- an assistant turn's `tool_calls` become call markup after its text, written by the same
  `ToolCallFormat` the parser reads back;
- `tool` results become `<tool_response>` blocks in a `user` turn (consecutive results share one
  turn, as Qwen does), since a template without tools rarely knows a `tool` role.

Use it when `template_supports_tools` is False and the request carries tools or tool history, and
parse the output with the same format (FALLBACK_FORMAT unless overridden).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from yaied.tools.formats import FALLBACK_FORMAT, ToolCallFormat, get_format

_HERMES_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""

_LLAMA3_PROMPT = """# Tools

Given the following functions, please respond with a JSON for a function call with its proper \
arguments that best answers the given prompt.

Respond in the format {{"name": function name, "parameters": dictionary of argument name and its \
value}}. Do not use variables.

{tools}"""

# The instructions per format; a format without an entry gets the hermes-style wording with its
# own call markup substituted by `tools_prompt`.
_PROMPTS = {"hermes": _HERMES_PROMPT, "llama3_json": _LLAMA3_PROMPT}

RESPONSE_START = "<tool_response>"
RESPONSE_END = "</tool_response>"
_TOOL_ROLES = ("tool", "function")  # "function": the deprecated functions API's result role


def template_supports_tools(chat_template: str | None) -> bool:
    """A heuristic: a template that names both `tools` and `tool_calls` renders tool definitions
    and earlier calls itself. The default model's ChatML names neither."""
    return bool(chat_template) and "tools" in chat_template and "tool_calls" in chat_template


def needs_fallback(
    chat_template: str | None,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
) -> bool:
    """Whether to call `render_fallback`: the request has tools or tool history (or null content,
    which ChatML-style templates cannot concatenate) and the template cannot render them."""
    if template_supports_tools(chat_template):
        return False
    return bool(tools) or any(
        m.get("tool_calls") or m.get("role") in _TOOL_ROLES or m.get("content") is None
        for m in messages
    )


def tools_prompt(
    tools: Sequence[Mapping[str, Any]], fmt: str | ToolCallFormat = FALLBACK_FORMAT
) -> str:
    """The system text that describes `tools` (OpenAI tool definitions) and the call format."""
    spec = get_format(fmt)
    lines = "\n".join(json.dumps(_tool_definition(t), ensure_ascii=False) for t in tools)
    return _PROMPTS.get(spec.name, _HERMES_PROMPT).format(tools=lines)


def render_fallback(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    fmt: str | ToolCallFormat = FALLBACK_FORMAT,
    tool_role: str = "user",
) -> list[dict[str, str]]:
    """Plain {role, content} messages that carry `tools` and the tool history as text.

    Content may be a string, None, or a list of text parts (joined with newlines, as the server
    does); anything else raises ValueError. Calls' `function.arguments` are JSON text, as OpenAI
    sends them; text that does not parse is inserted verbatim."""
    spec = get_format(fmt)
    out: list[dict[str, str]] = []
    previous_was_tool = False
    for i, message in enumerate(messages):
        role = message.get("role")
        if not isinstance(role, str):
            raise ValueError(f"messages[{i}].role must be a string")
        text = _content_text(message.get("content"), i)
        if role in _TOOL_ROLES:
            block = f"{RESPONSE_START}\n{text}\n{RESPONSE_END}"
            if previous_was_tool:
                out[-1]["content"] += "\n" + block  # consecutive results share one turn
            else:
                out.append({"role": tool_role, "content": block})
            previous_was_tool = True
            continue
        previous_was_tool = False
        calls = message.get("tool_calls") or []
        if role == "assistant" and calls:
            rendered = spec.render_calls(_call_parts(call, i, j) for j, call in enumerate(calls))
            text = f"{text}\n{rendered}" if text.strip() else rendered
        out.append({"role": role, "content": text})
    if tools:
        prompt = tools_prompt(tools, spec)
        if out and out[0]["role"] in ("system", "developer"):
            first = out[0]["content"]
            out[0] = {"role": "system", "content": f"{first}\n\n{prompt}" if first else prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _tool_definition(tool: Mapping[str, Any]) -> dict[str, Any]:
    """The parts of an OpenAI tool definition the model needs (not `strict`, not extra keys)."""
    function = tool.get("function", tool)  # accept a bare function definition too
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ValueError("each tool needs function.name")
    definition: dict[str, Any] = {"name": function["name"]}
    if function.get("description"):
        definition["description"] = function["description"]
    if function.get("parameters") is not None:
        definition["parameters"] = function["parameters"]
    return {"type": "function", "function": definition}


def _call_parts(call: Any, i: int, j: int) -> tuple[str, Any]:
    """(name, arguments) of one assistant tool call; arguments parsed when they are JSON text."""
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ValueError(f"messages[{i}].tool_calls[{j}] needs function.name")
    arguments = function.get("arguments")
    if arguments is None or arguments == "":
        return function["name"], {}
    if isinstance(arguments, str):
        try:
            return function["name"], json.loads(arguments)
        except ValueError:
            return function["name"], arguments  # verbatim: the client's text, not ours to fix
    return function["name"], arguments


def _content_text(content: Any, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, Mapping) and part.get("type") == "text"):
                raise ValueError(f"messages[{i}].content[{j}]: only text parts are supported")
            texts.append(str(part.get("text", "")))
        return "\n".join(texts)
    raise ValueError(f"messages[{i}].content must be a string, a list of parts or null")
