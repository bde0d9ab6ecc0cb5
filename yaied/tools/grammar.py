"""What a chat request's output must match once tools or reasoning are involved, as an xgrammar
structural tag: plain JSON data, built here from the tool-call format, compiled by
`yaied.structured` like any other constraint (kind ``structural_tag``).

- ``tool_choice`` ``required``: the output is one call (several when ``parallel_tool_calls``),
  nothing else, each call's arguments valid for that tool's schema; a named function: one call
  of it.
- ``auto``: free text until the format's trigger (``<tool_call>`` for hermes); from there the call
  is forced, so a call the model opens always parses and validates. After a call, text again
  (or EOS) unless parallel calls are off, when the output ends with the call.
- ``auto`` with a ``response_format`` too: either calls, or an answer in that format.
- With a reasoning parser: an optional ``<think> ... </think>`` block first (a required one when
  the prompt opened it), free text, and the constraint only after it.

The markup around a call comes from the same `ToolCallFormat` the parser reads back
(`call_prefix` / `call_suffix`), so what the grammar forces is what the parser accepts.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from yaied.core.grammar_spec import GrammarSpec
from yaied.tools.custom import INPUT, regex_literal
from yaied.tools.formats import ToolCallFormat, get_format
from yaied.tools.reasoning import THINK_END, THINK_START

# Whitespace allowed between JSON tokens of the arguments. xgrammar needs at least 1 here; a
# bound at all keeps a model from looping on whitespace inside a call.
ARGUMENT_WHITESPACE = 1
# A function without `parameters` takes none (OpenAI: "omitting parameters defines a function
# with an empty parameter list").
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
# The reasoning block may end with the blank line Qwen3 and R1 write before the answer; the
# grammar takes it as part of the block so that a constraint starts at the answer's first char.
_REASONING_ENDS = [THINK_END + "\n\n", THINK_END + "\n", THINK_END]

ChoiceMode = Literal["none", "auto", "required"]


@dataclass(frozen=True, slots=True)
class Tool:
    """One function tool of a request, as OpenAI defines it."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] = field(default_factory=lambda: dict(NO_PARAMETERS))
    strict: bool | None = None  # accepted; the grammar always enforces the schema in full
    # A free-form (custom) tool held to a regex: the pattern of its JSON-escaped input
    # (tools/custom.py); its arguments are then {"input": "<that>"} exactly.
    input_regex: str | None = None
    free_form: bool = False  # chat's custom tool: its calls are written back as custom calls

    def definition(self) -> dict[str, Any]:
        """The OpenAI tool definition, for chat templates and the fallback prompt."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """``tool_choice``: none, auto, required; a named function is ``required`` with `name`."""

    mode: ChoiceMode = "auto"
    name: str | None = None


def call_tag(fmt: ToolCallFormat, tool: Tool) -> dict[str, Any]:
    """One call of `tool` in `fmt`'s markup, its arguments held to the tool's schema (a custom
    tool's regex: to that pattern over the JSON string of its input)."""
    arguments: dict[str, Any] = {
        "type": "json_schema",
        "json_schema": tool.parameters,
        "max_whitespace_cnt": ARGUMENT_WHITESPACE,
    }
    if tool.input_regex is not None:
        head = regex_literal('{"' + INPUT + '": "')
        arguments = {"type": "regex", "pattern": head + tool.input_regex + regex_literal('"}')}
    return {
        "type": "tag",
        "begin": fmt.call_prefix(tool.name),
        "content": arguments,
        "end": fmt.call_suffix(),
    }


def _trigger(fmt: ToolCallFormat) -> str:
    """What opens a call in free text: the call's start tag, else the JSON head every call
    shares (llama3: '{"name": ')."""
    if fmt.call_start is not None:
        return fmt.call_start
    return '{"name": '  # how ToolCallFormat.call_prefix opens a bare call


def calls_format(
    fmt: ToolCallFormat, tools: Sequence[Tool], choice: ToolChoice, parallel: bool
) -> dict[str, Any] | None:
    """The structural-tag format for the calls `choice` allows; None for ``none``."""
    if choice.mode == "none" or not tools:
        return None
    selected = [t for t in tools if choice.name is None or t.name == choice.name]
    if not selected:
        raise ValueError(f"tool_choice names {choice.name!r}, which is not among the tools")
    tags = [call_tag(fmt, tool) for tool in selected]
    if choice.mode == "auto":
        return {
            "type": "triggered_tags",
            "triggers": [_trigger(fmt)],
            "tags": tags,
            "at_least_one": False,
            "stop_after_first": not parallel,
        }
    return {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": fmt.call_joiner,
        "at_least_one": True,
        # A named function is one call of it, as OpenAI and vLLM make it.
        "stop_after_first": not parallel or choice.name is not None,
    }


def constraint_format(spec: GrammarSpec) -> dict[str, Any]:
    """A response_format (any `GrammarSpec`) as one element of a structural tag."""
    if spec.kind in ("json_schema", "json_object"):
        schema = json.loads(spec.source) if spec.kind == "json_schema" else {"type": "object"}
        return {
            "type": "json_schema",
            "json_schema": schema,
            "max_whitespace_cnt": ARGUMENT_WHITESPACE,
        }
    if spec.kind == "regex":
        return {"type": "regex", "pattern": spec.source}
    if spec.kind == "grammar":
        return {"type": "grammar", "grammar": spec.source}
    if spec.kind == "choice":
        values = json.loads(spec.source)
        return {"type": "or", "elements": [{"type": "const_string", "value": v} for v in values]}
    return json.loads(spec.source)["format"]  # structural_tag


def reasoning_format(starts_inside: bool) -> dict[str, Any]:
    """The reasoning block before the answer. `starts_inside`: the prompt ended with
    ``<think>``, so the output starts in the block and must close it; otherwise the block is
    optional (a model asked not to think writes none)."""
    block = {
        "type": "tag",
        "begin": "" if starts_inside else THINK_START,
        "content": {"type": "any_text"},
        "end": list(_REASONING_ENDS),
    }
    return block if starts_inside else {"type": "optional", "content": block}


def output_structural_tag(
    *,
    tool_format: str | ToolCallFormat,
    tools: Sequence[Tool] = (),
    choice: ToolChoice | None = None,
    parallel: bool = True,
    constraint: GrammarSpec | None = None,
    reasoning: bool | None = None,
) -> dict[str, Any] | None:
    """The whole structural tag for one chat request, or None when nothing constrains it.

    `reasoning` is None without a reasoning parser, else whether the output starts inside the
    reasoning block (see `reasoning_format`). Without tools and without reasoning a constraint
    needs no structural tag (its own spec is used), so that case returns None too."""
    fmt = get_format(tool_format)
    choice = choice or ToolChoice()
    calls = calls_format(fmt, tools, choice, parallel)
    if calls is None:
        if constraint is None or reasoning is None:
            return None
        body = constraint_format(constraint)
    elif constraint is None or choice.mode != "auto":
        # required / named: the output is the calls; a response_format describes the answer,
        # which comes in a later turn, after the tool results.
        body = calls
    else:
        forced = calls_format(fmt, tools, ToolChoice("required"), parallel)
        assert forced is not None
        body = {"type": "or", "elements": [forced, constraint_format(constraint)]}
    if reasoning is not None:
        body = {"type": "sequence", "elements": [reasoning_format(reasoning), body]}
    return {"type": "structural_tag", "format": body}
