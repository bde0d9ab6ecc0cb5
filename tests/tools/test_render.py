"""The fallback renderer against the default model's real chat template, which knows no tools
and cannot concatenate a null content."""

from __future__ import annotations

import json

import jinja2
import pytest

from yaied.tools import needs_fallback, parse_tool_calls, render_fallback, tools_prompt

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
        "strict": True,
    },
}
TIME_TOOL = {"type": "function", "function": {"name": "get_time"}}
TOOLS = [WEATHER_TOOL, TIME_TOOL]
CALLS = [
    {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    },
    {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
]
LOOP = [
    {"role": "user", "content": "Weather and time in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": CALLS},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
    {"role": "assistant", "content": "21 degrees at 14:05."},
    {
        "role": "user",
        "content": [{"type": "text", "text": "And"}, {"type": "text", "text": "Rome?"}],
    },
]


def render(tokenizer, messages) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_the_default_template_breaks_on_tool_history(default_model_tokenizer):
    # Why the fallback exists: ChatML concatenates content, and null content is not a string.
    with pytest.raises(jinja2.exceptions.UndefinedError):
        render(default_model_tokenizer, LOOP[:2])
    assert needs_fallback(default_model_tokenizer.chat_template, LOOP, TOOLS)


def test_a_full_tool_loop_renders_with_the_default_template(default_model_tokenizer):
    messages = render_fallback(LOOP, TOOLS)
    assert all(set(m) == {"role", "content"} and isinstance(m["content"], str) for m in messages)
    prompt = render(default_model_tokenizer, messages)
    assert prompt.endswith("<|im_start|>assistant\n")
    # The tools: names, descriptions and parameter schemas, in the system turn, and no `strict`.
    system = prompt.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n# Tools")
    assert json.dumps(WEATHER_TOOL["function"]["parameters"]) in system
    assert "Current weather in a city." in system and '"get_time"' in system
    assert "strict" not in system and "<tool_call>" in system
    assert "SmolLM" not in prompt  # our system turn replaces the template's default one
    # The earlier calls, as hermes markup the parser reads back.
    turn = prompt.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    message = parse_tool_calls(turn, "hermes")
    assert message.content is None and not message.errors
    assert [(c.name, json.loads(c.arguments_json)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    # Both results in one user turn, in order, then the rest of the conversation.
    assert (
        "<|im_start|>user\n<tool_response>\n"
        '{"temp": 21}\n</tool_response>\n<tool_response>\n14:05\n</tool_response><|im_end|>'
    ) in prompt
    assert "21 degrees at 14:05.<|im_end|>" in prompt and "And\nRome?" in prompt


def test_the_client_system_message_comes_first(default_model_tokenizer):
    messages = render_fallback([{"role": "system", "content": "Be brief."}, *LOOP[:1]], TOOLS)
    assert messages[0] == {"role": "system", "content": "Be brief.\n\n" + tools_prompt(TOOLS)}
    assert render(default_model_tokenizer, messages).startswith(
        "<|im_start|>system\nBe brief.\n\n# Tools"
    )


def test_text_before_calls_and_unparsable_arguments_are_kept():
    call = {"function": {"name": "f", "arguments": "{oops"}}
    [_, assistant] = render_fallback(
        [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": "Let me see.", "tool_calls": [call]},
        ]
    )
    assert assistant["content"] == (
        'Let me see.\n<tool_call>\n{"name": "f", "arguments": {oops}\n</tool_call>'
    )


def test_without_tools_the_history_still_renders(default_model_tokenizer):
    messages = render_fallback(LOOP)
    assert messages[0]["role"] == "user"  # no tools: no tools prompt
    assert "<tool_call>" in render(default_model_tokenizer, messages)


def test_llama3_json_fallback_round_trips():
    messages = render_fallback(LOOP[:2], TOOLS, fmt="llama3_json", tool_role="tool")
    assert '"parameters": dictionary' in messages[0]["content"]
    message = parse_tool_calls(messages[2]["content"], "llama3_json")
    assert [c.name for c in message.tool_calls] == ["get_weather", "get_time"]


def test_needs_fallback():
    qwen_like = "{% for m in messages %}{{ m.tool_calls }}{% endfor %}{{ tools }}"
    chatml = "{{ message['content'] }}"
    assert not needs_fallback(qwen_like, LOOP, TOOLS)
    assert needs_fallback(chatml, [{"role": "user", "content": "hi"}], TOOLS)
    assert needs_fallback(chatml, [{"role": "assistant", "content": None}], None)
    assert not needs_fallback(chatml, [{"role": "user", "content": "hi"}], None)


def test_bad_input_is_a_value_error():
    with pytest.raises(ValueError, match="only text parts"):
        render_fallback([{"role": "user", "content": [{"type": "image_url"}]}])
    with pytest.raises(ValueError, match="function.name"):
        render_fallback([{"role": "user", "content": "x"}], [{"type": "function"}])
    with pytest.raises(ValueError, match=r"tool_calls\[0\]"):
        render_fallback([{"role": "assistant", "tool_calls": [{"id": "x"}]}])
