"""Choosing a tool-call format from a chat template, and the format specs' own rendering."""

from __future__ import annotations

import subprocess
import sys

import pytest

from yaied.tools import (
    FALLBACK_FORMAT,
    detect_format,
    get_format,
    parse_tool_calls,
    template_supports_tools,
)

# The parts of the real templates that carry the decision (Qwen2.5-Instruct, Llama 3.1 and 3.2).
QWEN_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    '{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.'
    '\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}'
    '{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}'
    '{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and '
    'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": '
    '<function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}'
    "{%- endif %}{%- for message in messages %}{%- if message.tool_calls %}"
    "{%- for tool_call in message.tool_calls %}{{- '\\n<tool_call>\\n' }}{%- endfor %}"
    "{%- endif %}{%- endfor %}"
)
LLAMA31_TEMPLATE = (
    "{%- if custom_tools is defined %}{%- set tools = custom_tools %}{%- endif %}"
    '{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}'
    "{%- for message in messages %}{%- if 'tool_calls' in message %}"
    "{%- if builtin_tools is defined and tool_call.name in builtin_tools %}"
    '{{- "<|python_tag|>" + tool_call.name + ".call(" }}{%- else %}'
    "{{- '{\"name\": \"' + tool_call.name + '\", ' }}{{- '\"parameters\": ' }}"
    '{{- tool_call.arguments | tojson }}{{- "}" }}{%- endif %}{%- endif %}{%- endfor %}'
)
LLAMA32_TEMPLATE = (
    "{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}"
    '{{- \'Respond in the format {"name": function name, "parameters": dictionary of argument '
    'name and its value}.\' }}{{- "Do not use variables.\\n\\n" }}'
    "{%- for t in tools %}{{- t | tojson(indent=4) }}{%- endfor %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}"
)
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
)


@pytest.mark.parametrize(
    "template, expected",
    [
        (QWEN_TEMPLATE, "hermes"),
        (LLAMA31_TEMPLATE, "llama3_json"),
        (LLAMA32_TEMPLATE, "llama3_json"),
        (CHATML, None),
        ("", None),
        (None, None),
        # ChatML with <tool_call> on a Llama base (Hermes 3): hermes wins.
        (QWEN_TEMPLATE + "<|start_header_id|>", "hermes"),
    ],
)
def test_detect_format_from_template_snippets(template, expected):
    assert detect_format(template) == expected


def test_detect_format_on_the_default_model(default_model_tokenizer):
    template = default_model_tokenizer.chat_template
    assert detect_format(template) is None  # SmolLM2's ChatML knows no tools...
    assert not template_supports_tools(template)  # ...so the fallback renders them
    assert FALLBACK_FORMAT == "hermes"


def test_the_override_wins_and_is_validated():
    assert detect_format(QWEN_TEMPLATE, override="llama3_json") == "llama3_json"
    assert detect_format(CHATML, override="Llama3-JSON") == "llama3_json"
    assert detect_format(None, override="hermes") == "hermes"
    with pytest.raises(ValueError, match="known: hermes, llama3_json"):
        detect_format(QWEN_TEMPLATE, override="mistral")


def test_template_supports_tools():
    assert template_supports_tools(QWEN_TEMPLATE)
    assert template_supports_tools(LLAMA31_TEMPLATE)
    assert not template_supports_tools(CHATML)
    assert not template_supports_tools(None)


def test_specs_render_what_their_families_write():
    hermes, llama = get_format("hermes"), get_format("llama3_json")
    assert hermes.render_call("f", {"a": 1}) == (
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    )
    assert llama.render_calls([("f", {}), ("g", '{"b": 2}')]) == (
        '{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"b": 2}}'
    )
    # The text a grammar puts around the arguments object, as the parser reads it back.
    for spec in (hermes, llama):
        text = spec.call_prefix('we"ird') + '{"x": [1]}' + spec.call_suffix()
        [call] = parse_tool_calls(text, spec).tool_calls
        assert (call.name, call.arguments_json) == ('we"ird', '{"x": [1]}')


def test_the_package_imports_without_torch():
    # The server layer imports it, and the server must not load torch.
    code = "import sys, yaied.tools; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
