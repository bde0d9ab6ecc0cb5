"""Parsing the tool-calling fields of a chat request: what is accepted, and the 400 for each
malformed field, naming it."""

from __future__ import annotations

import json

import pytest

from yaied.server.chat_protocol import parse_chat
from yaied.server.errors import APIError
from yaied.tools.grammar import NO_PARAMETERS, ToolChoice

USER = [{"role": "user", "content": "hi"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        "strict": True,
    },
}


def chat(**body):
    return parse_chat({"messages": USER, **body})


def test_tools_and_choices_parse():
    parsed = chat(tools=[WEATHER])
    assert parsed.tools.active and parsed.tools.choice == ToolChoice("auto")
    assert parsed.tools.tools[0].name == "get_weather" and parsed.tools.tools[0].strict
    assert parsed.tools.definitions()[0]["function"]["parameters"]["type"] == "object"
    assert chat(tools=[WEATHER], tool_choice="required").tools.choice.mode == "required"
    named = chat(
        tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}
    )
    assert named.tools.choice == ToolChoice("required", "get_weather")
    none = chat(tools=[WEATHER], tool_choice="none")
    assert not none.tools.active and none.tools.definitions()  # the template still sees them
    assert not chat().tools.active and chat(tool_choice="none").tools.choice.mode == "none"
    assert chat(tools=[WEATHER], parallel_tool_calls=False).tools.parallel is False
    bare = chat(tools=[{"type": "function", "function": {"name": "now"}}])
    assert bare.tools.tools[0].parameters == NO_PARAMETERS


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tools": {"a": 1}}, "tools"),
        ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tools": [{"function": {"name": "x" * 65}}]}, "tools[0].function.name"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        (
            {"tools": [{"function": {"name": "f", "parameters": "{not json"}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": [{"function": {"name": "f", "strict": "yes"}}]}, "tools[0].function.strict"),
        ({"tools": [{"function": {"name": f"f{i}"}} for i in range(129)]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {}}}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tools": [WEATHER], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
    ],
)
def test_malformed_tool_fields_are_400s_naming_the_field(body, param):
    with pytest.raises(APIError) as info:
        chat(**body)
    assert (info.value.status, info.value.param) == (400, param)


def test_tool_history_is_kept_for_the_template():
    messages = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "18C"}]},
    ]
    parsed = parse_chat({"messages": messages, "tools": [WEATHER]})
    assistant, tool = parsed.messages[1], parsed.messages[2]
    assert assistant["content"] == ""
    assert assistant["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    assert assistant["tool_calls"][0]["id"] == "call_1"
    assert tool == {"role": "tool", "content": "18C", "tool_call_id": "call_1"}


@pytest.mark.parametrize(
    "message, param",
    [
        ({"role": "tool", "content": "x"}, "messages[1].tool_call_id"),
        ({"role": "function", "name": "f", "content": "x"}, "messages[1]"),
        ({"role": "assistant", "tool_calls": {"id": 1}}, "messages[1].tool_calls"),
        ({"role": "assistant", "tool_calls": [{"id": "c"}]}, "messages[1].tool_calls[0]"),
        (
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
            "messages[1].tool_calls[0].function",
        ),
    ],
)
def test_malformed_tool_history_is_a_400(message, param):
    with pytest.raises(APIError) as info:
        parse_chat({"messages": [*USER, message]})
    assert (info.value.status, info.value.param) == (400, param)


def test_chat_custom_tools_parse_and_their_calls_come_back_as_functions():
    """Chat's custom tools (the format's grammar nested under "grammar"): a function of one
    string, its regex held; a named custom choice; an earlier custom call in the history is
    the function call the model made."""
    sql = {
        "type": "custom",
        "custom": {
            "name": "sql",
            "format": {
                "type": "grammar",
                "grammar": {"syntax": "regex", "definition": "SELECT [a-z]+;"},
            },
        },
    }
    note = {"type": "custom", "custom": {"name": "note", "description": "a note"}}
    parsed = chat(
        tools=[sql, note, WEATHER], tool_choice={"type": "custom", "custom": {"name": "sql"}}
    )
    tools = {tool.name: tool for tool in parsed.tools.tools}
    assert parsed.tools.custom == {"sql", "note"} and parsed.tools.choice.name == "sql"
    assert tools["sql"].input_regex == "SELECT ([a-z])+;" and tools["note"].input_regex is None
    assert tools["note"].parameters["properties"] == {"input": {"type": "string"}}
    history = [
        *USER,
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "c1", "type": "custom", "custom": {"name": "sql", "input": 'SELECT "a";'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "1"},
    ]
    call = chat(messages=history, tools=[sql]).messages[1]["tool_calls"][0]
    assert call["function"] == {"name": "sql", "arguments": json.dumps({"input": 'SELECT "a";'})}
    for bad, param in [
        (
            {
                "format": {
                    "type": "grammar",
                    "grammar": {"syntax": "lark", "definition": "start: a"},
                }
            },
            "tools[0].custom.format",
        ),
        ({"name": "a b"}, "tools[0].custom.name"),
    ]:
        with pytest.raises(APIError) as info:
            chat(tools=[{"type": "custom", "custom": {"name": "t", **bad}}])
        assert info.value.param == param


def test_each_api_names_its_own_tool_schema_field():
    """A tool's schema is `function.parameters` in chat, `parameters` in Responses and
    `input_schema` in Messages: a 400 about it names the client's field."""
    from yaied.server.messages_protocol import parse_anthropic
    from yaied.server.responses_protocol import parse_responses

    bad = "{not json"
    with pytest.raises(APIError) as info:
        chat(tools=[{"function": {"name": "f", "parameters": bad}}])
    assert info.value.param == "tools[0].function.parameters"
    assert chat(tools=[WEATHER]).tools.argument_specs()[0][1].param == (
        "tools[0].function.parameters"
    )
    with pytest.raises(APIError) as info:
        parse_responses({"input": "hi", "tools": [{"type": "function", "name": "f",
                                                  "parameters": bad}]})  # fmt: skip
    assert info.value.param == "tools[0].parameters"
    with pytest.raises(APIError) as info:
        parse_anthropic({"messages": USER, "max_tokens": 4,
                                "tools": [{"name": "f", "input_schema": bad}]})  # fmt: skip
    assert info.value.param == "tools[0].input_schema"
