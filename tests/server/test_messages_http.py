"""/v1/messages with the official anthropic client on the default model: messages.create and
messages.stream, a tool loop (tool_use, then tool_result), count_tokens, stop_sequences, and
errors in Anthropic's shape (including the guard's and the auth middleware's)."""

from __future__ import annotations

import anthropic
import httpx
import jsonschema
import pytest

from tests.server.conftest import MODEL

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
TOOLS = [{"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER}]
ASK = [{"role": "user", "content": "What is the weather in Paris tomorrow?"}]
# The current anthropic client dropped temperature, top_p and top_k; older clients and curl send
# them, and the server takes them.
GREEDY = {"temperature": 0, "top_k": 1}


@pytest.fixture
def client(live):
    return anthropic.Anthropic(base_url=live.url, api_key="none", max_retries=0)


def test_a_text_message(client):
    message = client.messages.create(
        model=MODEL, max_tokens=16, system="Be brief.", extra_body=GREEDY,
        messages=[{"role": "user", "content": "Say hello."}],
    )  # fmt: skip
    assert message.id.startswith("msg_") and message.role == "assistant"
    assert message.content[0].type == "text" and message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert 0 < message.usage.output_tokens <= 16 and message.usage.input_tokens > 0


def test_a_tool_loop(client):
    first = client.messages.create(
        model=MODEL, max_tokens=200, messages=ASK, tools=TOOLS, extra_body=GREEDY,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    )  # fmt: skip
    assert first.stop_reason == "tool_use"
    uses = [block for block in first.content if block.type == "tool_use"]
    assert uses and all(use.name == "get_weather" for use in uses)
    for use in uses:
        jsonschema.validate(use.input, WEATHER)
    results = [
        {"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21 C"} for use in uses
    ]
    history = [*ASK, {"role": "assistant", "content": first.content},
               {"role": "user", "content": results}]  # fmt: skip
    with client.messages.stream(
        model=MODEL, max_tokens=40, messages=history, tools=TOOLS, extra_body=GREEDY,
        tool_choice={"type": "none"},
    ) as stream:  # fmt: skip
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and "content_block_delta" in kinds
    assert final.content and final.content[0].type == "text" and final.content[0].text
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert final.usage.cache_read_input_tokens > 0  # the first turn's prompt was cached


def test_a_streamed_tool_use_assembles_its_input(client):
    with client.messages.stream(
        model=MODEL, max_tokens=200, messages=ASK, tools=TOOLS, extra_body=GREEDY,
        tool_choice={"type": "tool", "name": "get_weather"},
    ) as stream:  # fmt: skip
        deltas = [e for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert any(d.delta.type == "input_json_delta" for d in deltas)
    use = next(block for block in final.content if block.type == "tool_use")
    jsonschema.validate(use.input, WEATHER)
    assert final.stop_reason == "tool_use"


def test_stop_sequences_and_count_tokens(client):
    message = client.messages.create(
        model=MODEL, max_tokens=40, extra_body=GREEDY, stop_sequences=["e"],
        messages=[{"role": "user", "content": "Write the word 'hello' three times."}],
    )  # fmt: skip
    if message.stop_reason == "stop_sequence":
        assert message.stop_sequence == "e"
    count = client.messages.count_tokens(model=MODEL, messages=ASK, tools=TOOLS)
    assert count.input_tokens > 10


def test_message_start_splits_the_input_as_the_final_usage_does(client):
    """Clients read a stream's input tokens from message_start: there, as in message_delta,
    input_tokens leaves out the prompt tokens read from the cache."""
    ask = dict(model=MODEL, max_tokens=4, system="Be brief. " * 20, messages=ASK)
    total = client.messages.count_tokens(**{k: v for k, v in ask.items() if k != "max_tokens"})
    client.messages.create(**ask, extra_body=GREEDY)  # the prompt now cached
    with client.messages.stream(**ask, extra_body=GREEDY) as stream:
        start = next(e for e in stream if e.type == "message_start").message.usage
        final = stream.get_final_message().usage
    assert start.cache_read_input_tokens and start.cache_read_input_tokens > 0
    assert start.input_tokens + start.cache_read_input_tokens == total.input_tokens
    assert (start.input_tokens, start.cache_read_input_tokens) == (
        final.input_tokens,
        final.cache_read_input_tokens,
    )


def test_errors_are_in_anthropics_shape(live, client):
    url = live.url + "/v1/messages"
    for body, status in [
        ({"model": MODEL, "messages": ASK}, 400),  # max_tokens is required
        ({"model": MODEL, "messages": ASK, "max_tokens": 5, "nope": 1}, 400),
        ({"model": MODEL, "messages": ASK, "max_tokens": 5, "stop_sequences": "x"}, 400),
        ({"model": "other", "messages": ASK, "max_tokens": 5}, 404),
        ({"model": MODEL, "messages": [{"role": "tool", "content": "x"}], "max_tokens": 5}, 400),
    ]:
        response = httpx.post(url, json=body)
        assert response.status_code == status, response.text
        error = response.json()
        assert error["type"] == "error" and error["error"]["message"]
        assert error["error"]["type"] in ("invalid_request_error", "not_found_error")
    # a tool_result whose id no tool_use before it holds: named, with its place
    stray = {"type": "tool_result", "tool_use_id": "toolu_stray", "content": "sunny"}
    response = httpx.post(url, json={"model": MODEL, "max_tokens": 5, "messages": [
        *ASK, {"role": "assistant", "content": "Let me check."},
        {"role": "user", "content": [stray]}]})  # fmt: skip
    error = response.json()["error"]
    assert response.status_code == 400 and error["type"] == "invalid_request_error"
    assert "toolu_stray" in error["message"] and "messages[2].content[0]" in error["message"]
    refused = httpx.post(url, content=b"x", headers={"Content-Type": "text/plain"})
    assert refused.status_code == 415 and refused.json()["type"] == "error"
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=MODEL, max_tokens=0, messages=ASK)


def test_output_config_format_constrains_the_json(client):
    import json

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}},
              "required": ["name"]}  # fmt: skip
    message = client.messages.create(
        model=MODEL, max_tokens=60, messages=[{"role": "user", "content": "Name a city."}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )  # fmt: skip
    jsonschema.validate(json.loads(message.content[0].text), schema)


def test_a_prefill_is_continued(client, live):
    prefill = "My favourite colour is"
    messages = [{"role": "user", "content": "Name a colour."},
                {"role": "assistant", "content": prefill}]  # fmt: skip
    message = client.messages.create(
        model=MODEL, max_tokens=8, messages=messages, extra_body=GREEDY
    )
    chat = httpx.post(
        live.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0,
              "continue_final_message": True},
        timeout=60,
    ).json()  # fmt: skip
    text = chat["choices"][0]["message"]["content"]
    assert message.content[0].text == text and text  # the continuation alone
    with client.messages.stream(
        model=MODEL, max_tokens=8, messages=messages, extra_body=GREEDY
    ) as stream:
        assert stream.get_final_text() == text
    counted = client.messages.count_tokens(model=MODEL, messages=messages).input_tokens
    usage = message.usage
    assert counted == usage.input_tokens + (usage.cache_read_input_tokens or 0)
    spaced = [messages[0], {"role": "assistant", "content": prefill + " "}]
    with pytest.raises(anthropic.BadRequestError, match="trailing whitespace"):
        client.messages.create(model=MODEL, max_tokens=8, messages=spaced)


def test_context_management_clears_old_tool_results(client):
    """The beta client's clear_tool_uses edit: past its trigger, the results of all but the
    last `keep` tool uses are cleared before the model reads them, and the answer says how
    many and how many tokens (exactly: the prompt shrinks by that much), streamed or not."""
    messages = [{"role": "user", "content": "Check the weather in five cities."}]
    for i, city in enumerate(["Paris", "Rome", "Oslo", "Lima", "Kyiv"]):
        call = {"type": "tool_use", "id": f"toolu_{i}", "name": "get_weather",
                "input": {"city": city, "unit": "celsius"}}  # fmt: skip
        result = {"type": "tool_result", "tool_use_id": f"toolu_{i}",
                  "content": f"{city}: " + "sunny and mild, light wind. " * 8}  # fmt: skip
        messages += [{"role": "assistant", "content": [call]},
                     {"role": "user", "content": [result]}]  # fmt: skip
    edit = {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 200},
            "keep": {"type": "tool_uses", "value": 2}}  # fmt: skip
    common = dict(model=MODEL, max_tokens=4, messages=messages, tools=TOOLS, extra_body=GREEDY)
    plain = client.messages.create(**common)
    trimmed = client.beta.messages.create(
        **common, context_management={"edits": [edit]}, betas=["context-management-2025-06-27"]
    )
    (applied,) = trimmed.context_management.applied_edits
    assert applied.type == "clear_tool_uses_20250919" and applied.cleared_tool_uses == 3

    def prompt(message):
        return message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)

    assert applied.cleared_input_tokens == prompt(plain) - prompt(trimmed) > 150
    with client.beta.messages.stream(
        **common, context_management={"edits": [{**edit, "exclude_tools": ["get_weather"]}]},
        betas=["context-management-2025-06-27"],
    ) as stream:  # fmt: skip
        final = stream.get_final_message()
    assert final.context_management.applied_edits == []  # every use excluded: nothing cleared
    assert prompt(final) == prompt(plain)
    counted = client.beta.messages.count_tokens(
        model=MODEL, messages=messages, tools=TOOLS, context_management={"edits": [edit]},
        betas=["context-management-2025-06-27"],
    )  # fmt: skip
    assert counted.input_tokens == prompt(trimmed)
    assert counted.context_management.original_input_tokens == prompt(plain)


def test_tool_use_ids_are_anthropics_and_any_client_id_round_trips(client, live):
    """tool_use ids are Anthropic's toolu_ ones (chat completions keep OpenAI's call_), whole
    and streamed; ids a client sends back in its history keep whatever shape they have."""
    ask = dict(model=MODEL, max_tokens=200, messages=ASK, tools=TOOLS, extra_body=GREEDY,
               tool_choice={"type": "tool", "name": "get_weather"})  # fmt: skip
    whole = client.messages.create(**ask)
    with client.messages.stream(**ask) as stream:
        started = [e.content_block for e in stream if e.type == "content_block_start"]
        streamed = stream.get_final_message()
    ids = [b.id for m in (whole, streamed) for b in m.content if b.type == "tool_use"]
    ids += [b.id for b in started if b.type == "tool_use"]
    assert len(ids) >= 3 and all(i.startswith("toolu_") and len(i) > 20 for i in ids), ids
    chat = httpx.post(live.v1 + "/chat/completions", timeout=60, json={
        "model": MODEL, "messages": ASK, "max_tokens": 200, "temperature": 0,
        "tools": [{"type": "function", "function": {"name": "get_weather",
                                                     "parameters": WEATHER}}],
        "tool_choice": "required"}).json()  # fmt: skip
    assert chat["choices"][0]["message"]["tool_calls"][0]["id"].startswith("call_")
    for call_id in ("toolu_01A09q90qw90lq917835lq9", "call_abc123", "my-own.id:7"):
        use = {"type": "tool_use", "id": call_id, "name": "get_weather",
               "input": {"city": "Paris", "unit": "celsius"}}  # fmt: skip
        result = {"type": "tool_result", "tool_use_id": call_id, "content": "sunny"}
        history = [*ASK, {"role": "assistant", "content": [use]},
                   {"role": "user", "content": [result]}]  # fmt: skip
        answer = client.messages.create(model=MODEL, max_tokens=4, messages=history,
                                        tools=TOOLS, extra_body=GREEDY)  # fmt: skip
        assert answer.content and answer.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_count_tokens_takes_what_the_client_sends_it(client):
    """The client's count_tokens sends cache_control, output_config, speed and more beside the
    prompt: accepted as create accepts them, and the count is the prompt's."""
    kind = {"type": "text", "text": "Be kind.", "cache_control": {"type": "ephemeral"}}
    system = [{"type": "text", "text": "Be brief."}, kind]
    plain = client.messages.count_tokens(model=MODEL, messages=ASK, tools=TOOLS, system=system)
    counted = client.messages.count_tokens(
        model=MODEL, messages=ASK, tools=TOOLS, system=system, speed="standard",
        cache_control={"type": "ephemeral"}, output_config={"effort": "low"},
        workspace_id="ws_1", user_profile_id="up_1",
    )  # fmt: skip
    assert counted.input_tokens == plain.input_tokens > 10
    with pytest.raises(anthropic.BadRequestError, match="output_config"):
        client.messages.count_tokens(model=MODEL, messages=ASK, output_config={"effort": "huge"})
