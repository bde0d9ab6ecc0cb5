"""Tool calling over HTTP with the official openai client, on the embedded default model (whose
ChatML template knows no tools: the fallback renders them, hermes markup is parsed back)."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.server.conftest import MODEL

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
}
TIME_PARAMS = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}}}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather forecast for a city",
            "parameters": WEATHER_PARAMS,
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "The time", "parameters": TIME_PARAMS},
    },
]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
ASK = [{"role": "user", "content": "What is the weather in Paris tomorrow?"}]


@pytest.fixture
def client(live):
    return openai.OpenAI(base_url=live.v1, api_key="none", max_retries=0)


def check_calls(calls, names=None) -> None:
    assert calls, "no tool calls"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("seed", range(4))
def test_required_and_named_calls_validate_on_every_try(client, seed):
    for choice, names in [
        ("required", None),
        ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
    ]:
        response = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=TOOLS,
            tool_choice=choice,
            parallel_tool_calls=False,  # else a small model may go on calling up to max_tokens
            temperature=1.0,
            seed=seed,
            max_tokens=200,
        )
        result = response.choices[0]
        assert result.finish_reason == "tool_calls"
        assert result.message.content is None
        check_calls(result.message.tool_calls, names)
        if names:
            assert len(result.message.tool_calls) == 1


def test_a_streamed_call_assembles_from_deltas(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        stream=True,
        seed=3,
        temperature=0.7,
        max_tokens=200,
    )
    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or []:
            entry = calls.setdefault(part.index, {"arguments": ""})
            if part.id:
                assert "name" not in entry  # id and name come once, in the call's first delta
                entry.update(id=part.id, name=part.function.name)
            entry["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and "<tool_call>" not in content and not content.strip()
    for entry in calls.values():
        jsonschema.validate(json.loads(entry["arguments"]), SCHEMAS[entry["name"]])


def test_a_full_tool_loop(client):
    first = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        seed=1,
        max_tokens=200,
    )
    message = first.choices[0].message
    check_calls(message.tool_calls)
    history = [*ASK, message.model_dump(exclude_none=True)]  # content null, as the SDK sends it
    for call in message.tool_calls:
        result = {"forecast": "sunny", "temperature": 21}
        history.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
    final = client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=40
    )
    answer = final.choices[0]
    assert answer.finish_reason in ("stop", "length") and answer.message.tool_calls is None
    assert answer.message.content and "<tool_call>" not in answer.message.content
    # auto after a tool result: text or a call, either way well-formed
    again = client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, max_tokens=60
    )
    if again.choices[0].message.tool_calls:
        check_calls(again.choices[0].message.tool_calls)


def test_parallel_calls_each_validate(client):
    """With parallel calls a small model may keep calling until max_tokens cuts it: every call
    it completed still validates, and a cut-off one never reaches tool_calls."""
    response = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", seed=5, max_tokens=160
    )
    result = response.choices[0]
    assert result.finish_reason in ("tool_calls", "length")
    check_calls(result.message.tool_calls)


def test_auto_lets_the_model_answer_in_text(client):
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello."}],
        tools=TOOLS,
        max_tokens=30,
        seed=0,
    )
    result = response.choices[0]
    if result.message.tool_calls:
        check_calls(result.message.tool_calls)
    else:
        assert result.message.content and "<tool_call>" not in result.message.content


def test_tool_errors_over_http(live):
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS}
    named = {"type": "function", "function": {"name": "nope"}}
    for extra, param in [
        ({"tool_choice": named}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"messages": [*ASK, {"role": "tool", "content": "x"}]}, "messages[1].tool_call_id"),
    ]:
        response = httpx.post(live.v1 + "/chat/completions", json={**body, **extra})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param


def test_the_openai_client_parses_strict_tools_into_pydantic(client):
    """openai's parse() with pydantic_function_tool: strict tools (additionalProperties false,
    every field required), arguments parsed into the model by the SDK itself."""
    from pydantic import BaseModel, Field

    class LookUp(BaseModel):
        city: str = Field(max_length=30)
        days: int = Field(ge=1, le=7)

    completion = client.chat.completions.parse(
        model=MODEL,
        messages=ASK,
        tools=[openai.pydantic_function_tool(LookUp)],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
        seed=2,
    )
    call = completion.choices[0].message.tool_calls[0]
    assert isinstance(call.function.parsed_arguments, LookUp)


SQL = r'SELECT [a-z_]{1,20} FROM [a-z_]{1,20}( WHERE [a-z_]{1,20} = "[^"\n]{1,12}")?;'
SQL_FORMAT = {"type": "grammar", "grammar": {"syntax": "regex", "definition": SQL}}
RUN_SQL = {"type": "custom", "custom": {"name": "run_sql", "format": SQL_FORMAT}}


def test_a_custom_tool_call_in_chat_whole_and_streamed(client, live):
    """Chat's custom tools: the call comes back as {"type": "custom", "custom": {"name",
    "input"}} with the input matching the tool's regex; streamed, its input arrives in pieces
    that join to a matching input; the call goes back in the history."""
    ask = [{"role": "user", "content": "How many orders did alice place? Query the orders table."}]
    choice = {"type": "custom", "custom": {"name": "run_sql"}}
    common = dict(model=MODEL, messages=ask, tools=[RUN_SQL, *TOOLS], tool_choice=choice,
                  temperature=0, max_tokens=120)  # fmt: skip
    whole = client.chat.completions.create(**common)
    call = whole.choices[0].message.tool_calls[0]
    assert call.type == "custom" and call.custom.name == "run_sql"
    assert re.fullmatch(SQL, call.custom.input), call.custom.input
    assert whole.choices[0].finish_reason == "tool_calls"
    pieces, starts = [], []
    with httpx.stream("POST", live.v1 + "/chat/completions", json={**common, "stream": True},
                      timeout=120) as stream:  # fmt: skip
        for line in stream.iter_lines():
            if line.startswith("data: {"):
                for delta in json.loads(line[6:])["choices"][0]["delta"].get("tool_calls") or []:
                    starts += [delta] if "id" in delta else []
                    pieces.append(delta["custom"]["input"])
    assert [(s["type"], s["custom"]["name"]) for s in starts] == [("custom", "run_sql")]
    assert len(pieces) > 2 and re.fullmatch(SQL, "".join(pieces)), pieces
    history = [*ask, whole.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "3 orders"}]  # fmt: skip
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=[RUN_SQL],
                                            max_tokens=8, temperature=0)  # fmt: skip
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


BAD_SCHEMAS = [
    ({"type": "odd"}, 'Unsupported type "odd"'),
    ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum greater than maximum"),
    # (an outside $ref passes in a tool with a warning: tests/tools/test_grammar.py)
    ({"type": "object", "required": ["a"], "additionalProperties": False}, "no object"),
]


@pytest.mark.parametrize(("schema", "why"), BAD_SCHEMAS)
def test_a_tool_schema_that_cannot_be_enforced_is_a_400_naming_the_tool(live, schema, why):
    """It was a 400 with param "tools" and "invalid structural tag: ...", which named neither the
    tool nor the field, in words of the grammar library the client never sent. Each API names
    its own field."""
    good = {"name": "get_time", "parameters": TIME_PARAMS}
    bad = {"name": "get_weather", "parameters": schema}
    chat_tools = [{"type": "function", "function": f} for f in (good, bad)]
    cases = [
        ("/chat/completions", {"model": MODEL, "messages": ASK, "tools": chat_tools},
         "tools[1].function.parameters"),
        ("/responses", {"model": MODEL, "input": "hi",
                        "tools": [{"type": "function", **f} for f in (good, bad)]},
         "tools[1].parameters"),
        ("/messages", {"model": MODEL, "messages": ASK, "max_tokens": 8,
                       "tools": [{"name": f["name"], "input_schema": f["parameters"]}
                                 for f in (good, bad)]},
         "tools[1].input_schema"),
    ]  # fmt: skip
    for path, body, param in cases:
        for choice in (None, "required"):
            if choice is not None and path == "/chat/completions":
                body = {**body, "tool_choice": choice}
            response = httpx.post(live.v1 + path, json=body, timeout=60)
            assert response.status_code == 400, (path, response.text)
            error = response.json()["error"]
            message = error["message"]
            assert error.get("param", param) == param, (path, error)
            assert message.startswith(param) and "'get_weather'" in message, message
            assert why in message and "structural tag" not in message, message


@pytest.mark.parametrize(("schema", "why"), BAD_SCHEMAS[:2])
def test_a_bad_output_format_beside_tools_is_a_400_naming_its_field(live, schema, why):
    """A response_format (Responses: text.format) that cannot be enforced, sent with good tools,
    was reported as the tools' fault ("the tools cannot be enforced together", param "tools"):
    the error names the format's field, as it does without tools."""
    fmt = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}
    cases = [
        ("/chat/completions", {"model": MODEL, "messages": ASK, "tools": TOOLS,
                               "response_format": fmt}, "response_format.json_schema.schema"),
        ("/responses", {"model": MODEL, "input": "hi", "tools": [
            {"type": "function", **t["function"]} for t in TOOLS],
            "text": {"format": {"type": "json_schema", "name": "out", "schema": schema}}},
         "text.format.schema"),
    ]  # fmt: skip
    for path, body, param in cases:
        response = httpx.post(live.v1 + path, json=body, timeout=60)
        assert response.status_code == 400, (path, response.text)
        error = response.json()["error"]
        assert error["param"] == param and why in error["message"], (path, error)
        without_tools = {k: v for k, v in body.items() if k != "tools"}
        alone = httpx.post(live.v1 + path, json=without_tools, timeout=60)
        assert alone.status_code == 400 and alone.json()["error"] == error, alone.text
