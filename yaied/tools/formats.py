"""Tool-call formats as data: how each model family writes its calls, and which family a chat
template belongs to.

One `ToolCallFormat` per family feeds three consumers that must agree on the markup: the streaming
parser (`parser.py`) reads calls back, the fallback renderer (`render.py`) writes earlier calls into
a prompt, and the grammar that forces a call (later) needs the text around the arguments object
(`call_prefix` / `call_suffix`). Keeping the facts in one frozen record means a new family is a new
entry here, not a new parser.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ToolCallFormat:
    """How one model family writes tool calls in its output text."""

    name: str
    families: str  # for error messages and docs only
    # Markup around EACH call (hermes: <tool_call> ... </tool_call>); None: calls are bare JSON.
    call_start: str | None
    call_end: str | None
    # A marker that opens a run of calls wherever it appears (llama3's <|python_tag|>). It is a
    # special token, so it reaches the parser only when the detokenizer keeps special tokens; the
    # parser accepts calls with or without it.
    bot_token: str | None
    # A message whose first non-space character is "{" is a run of calls (llama3). Only at the
    # start: a "{" later in prose is prose, and a JSON answer that is not a call goes to content.
    bare_json_at_start: bool
    separator: str | None  # between calls of one run (llama3 writes "; ")
    arguments_key: str  # the key this family writes the arguments under
    # Keys the parser accepts for the arguments, first match wins: models of one family do not
    # always use their documented key (Llama 3 sometimes writes "arguments").
    accepted_argument_keys: tuple[str, ...]
    # Each group is a set of strings that, ALL present in a chat template, mark this family.
    template_markers: tuple[tuple[str, ...], ...]
    call_joiner: str  # between rendered calls of one assistant turn

    def call_prefix(self, name: str) -> str:
        """The text before a call's arguments object (what a grammar emits before the schema)."""
        head = f'{{"name": {json.dumps(name, ensure_ascii=False)}, "{self.arguments_key}": '
        if self.call_start is None:
            return head
        return f"{self.call_start}\n{head}"

    def call_suffix(self) -> str:
        """The text after a call's arguments object."""
        if self.call_end is None:
            return "}"
        return "}\n" + self.call_end

    def render_call(self, name: str, arguments: Any) -> str:
        """One call as the model would write it. `arguments` is a JSON value, or a string that is
        inserted verbatim (an OpenAI history carries arguments as JSON text already)."""
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        return self.call_prefix(name) + arguments + self.call_suffix()

    def render_calls(self, calls: Iterable[tuple[str, Any]]) -> str:
        """Several calls of one assistant turn, joined the way this family separates them."""
        return self.call_joiner.join(self.render_call(name, args) for name, args in calls)

    @property
    def triggers(self) -> tuple[str, ...]:
        """Markers that open calls anywhere in the text (the bare-JSON start is not one)."""
        return tuple(t for t in (self.call_start, self.bot_token) if t)


HERMES = ToolCallFormat(
    name="hermes",
    families="Qwen2.5, Qwen3, Hermes 2/3, and the fallback for templates without tools",
    call_start="<tool_call>",
    call_end="</tool_call>",
    bot_token=None,
    bare_json_at_start=False,
    separator=None,
    arguments_key="arguments",
    accepted_argument_keys=("arguments", "parameters"),
    template_markers=(("<tool_call>",),),
    call_joiner="\n",
)

LLAMA3_JSON = ToolCallFormat(
    name="llama3_json",
    families="Llama 3.1, 3.2, 3.3 (JSON custom tools)",
    call_start=None,
    call_end=None,
    bot_token="<|python_tag|>",
    bare_json_at_start=True,
    separator=";",
    arguments_key="parameters",
    accepted_argument_keys=("parameters", "arguments"),
    # <|python_tag|> appears in the 3.1 template; "parameters" with Llama 3 headers covers the
    # templates that only describe the JSON format.
    template_markers=(("<|python_tag|>",), ('"parameters"', "<|start_header_id|>")),
    call_joiner="; ",
)

# Detection order matters: a template with <tool_call> is hermes even on a Llama base
# (Hermes-3-Llama-3.1 keeps Llama's name but writes ChatML and hermes calls).
FORMATS: Mapping[str, ToolCallFormat] = {f.name: f for f in (HERMES, LLAMA3_JSON)}

# What the server uses when a template has no tool format of its own (render.py writes the
# tool prompt and the earlier calls in this format, so the parser must read the same one).
FALLBACK_FORMAT = "hermes"


def get_format(fmt: str | ToolCallFormat) -> ToolCallFormat:
    """The spec for a name (as given to --tool-call-parser), or the spec itself."""
    if isinstance(fmt, ToolCallFormat):
        return fmt
    key = fmt.strip().lower().replace("-", "_")
    try:
        return FORMATS[key]
    except KeyError:
        known = ", ".join(sorted(FORMATS))
        raise ValueError(f"unknown tool-call format {fmt!r}; known: {known}") from None


def detect_format(chat_template: str | None, override: str | None = None) -> str | None:
    """The tool-call format of a model, from its chat template text.

    `override` (the --tool-call-parser flag) wins and is validated. Without it, the first format
    whose markers all appear in the template is chosen; None means the template has no tool-call
    markup of its own, and the caller should render tools with `render.render_fallback` and parse
    with FALLBACK_FORMAT."""
    if override:
        return get_format(override).name
    if not chat_template:
        return None
    for spec in FORMATS.values():
        if any(all(m in chat_template for m in group) for group in spec.template_markers):
            return spec.name
    return None
