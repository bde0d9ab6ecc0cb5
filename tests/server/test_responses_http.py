"""/v1/responses with the official openai client on the default model: whole and streamed
responses, a function-tool loop over two turns through previous_response_id and one through
item references, a custom (free-form) tool held to a regex, responses.parse into a pydantic
model, GET and DELETE, input_items page by page, and the 4xx of bad requests."""

from __future__ import annotations

import json
import re
import time

import httpx
import jsonschema
import openai
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
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The weather forecast for a city",
        "parameters": WEATHER,
    }
]
ASK = "What is the weather in Paris tomorrow?"

# Asks the default model answers at length (greedy, past 600 tokens): a cancel finds the call
# running ("Count from 1 to 500" gets 9 tokens, often done before the cancel came).
LONG_ASK = "Write a long story about a dragon who learns to bake bread."


@pytest.fixture
def client(live):
    return openai.OpenAI(base_url=live.v1, api_key="none", max_retries=0)


def _calls(response) -> list:
    return [item for item in response.output if item.type == "function_call"]


def test_a_text_response(client):
    response = client.responses.create(
        model=MODEL, input="Say hello.", instructions="Be brief.", max_output_tokens=16
    )
    assert response.id.startswith("resp_") and response.status in ("completed", "incomplete")
    assert response.output_text and response.output[0].type == "message"
    assert response.usage.input_tokens > 0 and 0 < response.usage.output_tokens <= 16
    assert client.responses.retrieve(response.id).output_text == response.output_text
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_a_tool_loop_over_two_turns_streamed_and_whole(client):
    first = client.responses.create(
        model=MODEL, input=ASK, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=200, temperature=0,
    )  # fmt: skip
    calls = _calls(first)
    assert calls and first.status == "completed"
    for call in calls:
        assert call.name == "get_weather" and call.call_id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), WEATHER)
    results = [
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "sunny"}'}
        for call in calls
    ]
    with client.responses.stream(
        model=MODEL, input=results, previous_response_id=first.id, tools=TOOLS,
        tool_choice="none", max_output_tokens=40, temperature=0,
    ) as stream:  # fmt: skip
        kinds = [event.type for event in stream]
        second = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed",)
    assert "response.output_text.delta" in kinds and "response.output_item.added" in kinds
    assert second.output_text and second.previous_response_id == first.id
    # the second turn's prompt starts with the first's: most of it came from the cache
    assert second.usage.input_tokens_details.cached_tokens > first.usage.input_tokens // 2


def test_a_streamed_call_carries_argument_deltas(client):
    with client.responses.stream(
        model=MODEL, input=ASK, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=200, temperature=0,
    ) as stream:  # fmt: skip
        events = list(stream)
        final = stream.get_final_response()
    numbers = [event.sequence_number for event in events]
    assert numbers == list(range(len(events)))
    assert any(e.type == "response.function_call_arguments.delta" for e in events)
    jsonschema.validate(json.loads(_calls(final)[0].arguments), WEATHER)


def test_parse_into_a_pydantic_model(client):
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=30)
        # Bounded, so the grammar ends the number: unbounded, a sampled one can run past
        # max_output_tokens.
        population: int = Field(ge=0, le=100_000_000)

    response = client.responses.parse(
        model=MODEL,
        input="Describe Paris as JSON.",
        text_format=City,
        max_output_tokens=80,
        temperature=0,
    )
    assert isinstance(response.output_parsed, City)


def test_input_items_list_the_turns_input_page_by_page(client):
    items = [
        {"role": "developer", "content": "Answer in one word."},
        {"role": "user", "content": [{"type": "input_text", "text": "Capital of France?"}]},
    ]
    response = client.responses.create(model=MODEL, input=items, max_output_tokens=4, temperature=0)
    newest_first = client.responses.input_items.list(response.id)
    assert [item.role for item in newest_first.data] == ["user", "developer"]
    assert newest_first.data[0].content[0].text == "Capital of France?"
    assert newest_first.first_id == newest_first.data[0].id and not newest_first.has_more
    # one item a page: the client follows `after` to the end
    pages = client.responses.input_items.list(response.id, order="asc", limit=1)
    assert pages.has_more and len(pages.data) == 1
    assert [item.id for item in pages] == [item.id for item in newest_first.data[::-1]]


def test_a_tool_loop_through_item_references(client):
    """Codex-style: the second turn re-sends the conversation, naming the stored call by its
    id instead of previous_response_id."""
    first = client.responses.create(
        model=MODEL, input=ASK, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=200, temperature=0,
    )  # fmt: skip
    call = _calls(first)[0]
    second = client.responses.create(
        model=MODEL, tools=TOOLS, tool_choice="none", max_output_tokens=20, temperature=0,
        input=[
            {"role": "user", "content": ASK},
            {"type": "item_reference", "id": call.id},
            {"type": "function_call_output", "call_id": call.call_id,
             "output": [{"type": "input_text", "text": '{"sky": "sunny"}'}]},
        ],
    )  # fmt: skip
    assert second.status in ("completed", "incomplete") and second.output_text
    listed = client.responses.input_items.list(second.id, order="asc")
    assert [item.type for item in listed.data] == ["message", "function_call",
                                                   "function_call_output"]  # fmt: skip
    assert listed.data[1].id == call.id and listed.data[1].arguments == call.arguments


def _poll(client, response_id: str, seconds: float = 120.0):
    deadline = time.monotonic() + seconds
    while True:
        response = client.responses.retrieve(response_id)
        if response.status not in ("queued", "in_progress") or time.monotonic() > deadline:
            return response
        time.sleep(0.05)


def test_a_background_response_runs_on_and_is_polled(client):
    started = client.responses.create(
        model=MODEL, input="Say hello.", background=True, max_output_tokens=16, temperature=0
    )
    assert started.background and started.status in ("queued", "in_progress")
    assert not started.output
    done = _poll(client, started.id)
    assert done.status in ("completed", "incomplete") and done.output_text
    assert done.usage.output_tokens > 0
    # cancelling a finished one returns it as it ended
    assert client.responses.cancel(started.id).status == done.status
    listed = client.responses.input_items.list(started.id)
    assert listed.data[0].content[0].text == "Say hello."


def test_a_background_response_is_cancelled(client, live):
    long = client.responses.create(
        model=MODEL, input=LONG_ASK, background=True,
        max_output_tokens=900, temperature=0,
    )  # fmt: skip
    # a chain cannot continue a response that is still running
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input="And then?", previous_response_id=long.id)
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and cancelled.error is None
    assert client.responses.retrieve(long.id).status == "cancelled"
    assert cancelled.usage.output_tokens < 900
    # deleting one that runs cancels it first (its end would otherwise store it again)
    doomed = client.responses.create(
        model=MODEL, input=LONG_ASK, background=True, max_output_tokens=900
    )
    client.responses.delete(doomed.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(doomed.id)
    # only background responses can be cancelled
    plain = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(plain.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_nope")
    # nothing of it is left running in the engine
    deadline = time.monotonic() + 30
    running = None
    while time.monotonic() < deadline:
        metrics = httpx.get(live.url + "/metrics").text
        running = [line for line in metrics.splitlines()
                   if line.startswith("yaied:num_requests_running")]  # fmt: skip
        if running and all(line.endswith(" 0.0") for line in running):
            break
        time.sleep(0.1)
    assert running and all(line.endswith(" 0.0") for line in running), running


def test_truncation_auto_drops_the_oldest_turns_that_overflow(client):
    """A chain that outgrows the context (1024 tokens here): OpenAI's code
    context_length_exceeded without truncation, the oldest stored turns dropped with "auto"."""
    words = "the cat sat on the mat and looked at the sun "
    first = client.responses.create(
        model=MODEL, input=words * 55, max_output_tokens=8, temperature=0
    )
    assert first.usage.input_tokens > 550
    follow = {"model": MODEL, "input": words * 40, "previous_response_id": first.id,
              "max_output_tokens": 8, "temperature": 0}  # fmt: skip
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(**follow)
    assert caught.value.code == "context_length_exceeded"
    second = client.responses.create(**follow, truncation="auto")
    assert second.truncation == "auto" and second.status in ("completed", "incomplete")
    assert second.usage.input_tokens < first.usage.input_tokens  # the first turn is gone
    # tools beside a JSON answer: the output grammar is settled afresh on each try (a second
    # try must not wrap the first try's grammar again)
    answer = {"type": "json_schema", "name": "weather", "schema": WEATHER}
    third = client.responses.create(
        **{**follow, "input": words * 36 + ASK, "max_output_tokens": 80}, truncation="auto",
        tools=TOOLS, tool_choice="auto", parallel_tool_calls=False, text={"format": answer},
    )  # fmt: skip
    assert third.status == "completed"
    calls = _calls(third)
    for value in [json.loads(c.arguments) for c in calls] or [json.loads(third.output_text)]:
        jsonschema.validate(value, WEATHER)


SQL = r'SELECT [a-z_]{1,20} FROM [a-z_]{1,20}( WHERE [a-z_]{1,20} = "[^"\n]{1,12}")?;'
CUSTOM_TOOLS = [
    {"type": "custom", "name": "run_sql", "description": "Runs one SQL query on the shop database",
     "format": {"type": "grammar", "syntax": "regex", "definition": SQL}},
    {"type": "custom", "name": "note", "description": "Writes a free-form note"},
]  # fmt: skip


def test_a_custom_tool_call_holds_its_regex_and_continues(client):
    """A free-form tool with a regex grammar, forced: its custom_tool_call's input matches the
    pattern (quotes and all, through the JSON-escaped grammar), whole and streamed (the deltas
    join to the input); its output continues the conversation."""
    ask = "How many orders did alice place? Query the orders table."
    choice = {"type": "custom", "name": "run_sql"}
    # greedy, so that the call completes within its budget (a sampled one can ramble)
    first = client.responses.create(
        model=MODEL, input=ask, tools=CUSTOM_TOOLS, tool_choice=choice, max_output_tokens=120,
        temperature=0,
    )  # fmt: skip
    call = first.output[-1]
    assert call.type == "custom_tool_call" and call.name == "run_sql", first.output
    assert re.fullmatch(SQL, call.input), call.input
    with client.responses.stream(
        model=MODEL, input=ask, tools=CUSTOM_TOOLS, tool_choice=choice, max_output_tokens=120,
        temperature=0,
    ) as stream:  # fmt: skip
        events = list(stream)
    kinds = [event.type for event in events]
    assert "response.custom_tool_call_input.done" in kinds and kinds[-1] == "response.completed"
    streamed = events[-1].response.output[-1]
    done = next(e for e in events if e.type == "response.custom_tool_call_input.done")
    assert streamed.type == "custom_tool_call" and done.input == streamed.input
    deltas = [e.delta for e in events if e.type == "response.custom_tool_call_input.delta"]
    assert deltas and "".join(deltas) == streamed.input  # decoded from the arguments' JSON
    assert re.fullmatch(SQL, streamed.input), streamed.input
    output = {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "3 orders"}
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, input=[output], tools=CUSTOM_TOOLS,
        max_output_tokens=16,
    )  # fmt: skip
    assert second.status in ("completed", "incomplete")
    assert second.usage.input_tokens_details.cached_tokens > 0
    listed = client.responses.input_items.list(second.id)
    assert [item.type for item in listed.data] == ["custom_tool_call_output"]


def test_output_text_logprobs_whole_and_streamed(client):
    """include message.output_text.logprobs (with top_logprobs): a logprob per output token
    with its alternatives, the tokens spelling the text; streamed, the deltas carry them."""
    ask = dict(model=MODEL, input="Say hello.", max_output_tokens=12, temperature=0,
               include=["message.output_text.logprobs"])  # fmt: skip
    whole = client.responses.create(**ask, top_logprobs=2)
    part = whole.output[0].content[0]
    assert len(part.logprobs) == whole.usage.output_tokens
    assert "".join(entry.token for entry in part.logprobs) == part.text
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in part.logprobs)
    with client.responses.stream(**ask) as stream:
        events = list(stream)
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    final = events[-1].response
    assert sum(len(e.logprobs) for e in deltas) == final.usage.output_tokens
    assert [e.token for d in deltas for e in d.logprobs] == [
        e.token for e in final.output[0].content[0].logprobs
    ]


def test_bad_requests_get_4xx(live):
    url = live.v1 + "/responses"
    for body, status, param in [
        ({"model": MODEL, "input": "x", "nope": 1}, 400, "nope"),
        ({"model": MODEL}, 400, "input"),
        ({"model": MODEL, "input": "x", "background": True, "store": False}, 400, "background"),
        ({"model": MODEL, "input": "x", "background": True, "stream": True}, 400, "stream"),
        ({"model": MODEL, "input": "x", "max_output_tokens": "9"}, 400, "max_output_tokens"),
        ({"model": MODEL, "input": "x", "previous_response_id": "resp_x"}, 404,
         "previous_response_id"),
        ({"model": MODEL, "input": "x", "tools": [{"type": "file_search"}]}, 400, "tools[0]"),
        ({"model": MODEL, "input": "x", "top_logprobs": 21}, 400, "top_logprobs"),
        ({"model": MODEL, "input": "x", "include": ["message.output_text.logprobs"],
          "tools": TOOLS}, 400, "include"),
        ({"model": MODEL, "input": "x", "tools": [{"type": "custom", "name": "p", "format": {
            "type": "grammar", "syntax": "lark", "definition": "start: x"}}]}, 400,
         "tools[0].format"),
        ({"model": MODEL, "input": "x", "text": {"format": {"type": "json_schema"}}}, 400,
         "text.format"),
    ]:  # fmt: skip
        response = httpx.post(url, json=body)
        assert response.status_code == status, response.text
        assert response.json()["error"]["param"] == param
    reference = {"type": "item_reference", "id": "fc_0123_0"}
    response = httpx.post(url, json={"model": MODEL, "input": [reference]})
    assert response.status_code == 404 and response.json()["error"]["param"] == "input[0]"
    stored = httpx.post(url, json={"model": MODEL, "input": "x", "max_output_tokens": 1})
    items_url = f"{url}/{stored.json()['id']}/input_items"
    for query, status, param in [
        ("limit=0", 400, "limit"), ("limit=101", 400, "limit"), ("limit=x", 400, "limit"),
        ("order=up", 400, "order"), ("after=msg_nope", 400, "after"), ("page=2", 400, "page"),
    ]:  # fmt: skip
        response = httpx.get(f"{items_url}?{query}")
        assert response.status_code == status, (query, response.text)
        assert response.json()["error"]["param"] == param
    assert httpx.get(f"{url}/resp_nope/input_items").status_code == 404


def test_a_call_output_that_answers_no_call_is_refused(client):
    """OpenAI's 400 for a function_call_output whose call_id no call of the conversation has:
    in a replayed input, after a previous_response_id, and in a conversation."""
    stray = {"type": "function_call_output", "call_id": "call_nope", "output": "sunny"}
    first = client.responses.create(model=MODEL, input="Hi", max_output_tokens=1, temperature=0)
    conversation = client.conversations.create(items=[{"role": "user", "content": "Hi"}])
    for extra in ({"input": [{"role": "user", "content": ASK}, stray]},
                  {"input": [stray], "previous_response_id": first.id},
                  {"input": [stray], "conversation": conversation.id}):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(model=MODEL, tools=TOOLS, max_output_tokens=1, **extra)
        error = caught.value.body
        assert error["type"] == "invalid_request_error" and error["param"] == "input", error
        assert error["message"] == (
            "No tool call found for function call output with call_id call_nope."
        )
    assert len(list(client.conversations.items.list(conversation.id))) == 1  # nothing added


def test_a_cancelled_foreground_response_ends_failed_not_completed(client, live):
    # POST /v1/requests/{id}/cancel (or the drain's abort on a stop) cuts a foreground call
    # short: its stream ends with response.failed, never response.completed, the store keeps
    # it as failed, and its conversation gets none of the cut turn.
    conversation = client.conversations.create()
    body = {
        "model": MODEL, "input": LONG_ASK, "stream": True,
        "max_output_tokens": 900, "temperature": 0, "conversation": conversation.id,
    }  # fmt: skip
    headers = {"X-Request-Id": "fg-cancel-me"}
    events = []
    with httpx.stream("POST", live.v1 + "/responses", json=body, headers=headers, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if events[-1]["type"] == "response.output_text.delta" and len(events) == 6:
                    cancel = httpx.post(live.url + "/v1/requests/fg-cancel-me/cancel")
                    assert cancel.json()["cancelled"] == 1
    last = events[-1]
    assert last["type"] == "response.failed", last["type"]
    assert last["response"]["status"] == "failed" and last["response"]["error"]
    assert client.responses.retrieve(last["response"]["id"]).status == "failed"
    assert not list(client.conversations.items.list(conversation.id))


def test_a_bad_max_output_tokens_is_named_as_the_client_sent_it(live):
    """The engine's check of max_tokens speaks chat's names; /v1/responses's client sent
    max_output_tokens, and the error names that, in its param and its message."""
    for asked in (0, 5000):  # below 1; past the context
        response = httpx.post(live.v1 + "/responses", json={
            "model": MODEL, "input": "x", "max_output_tokens": asked})  # fmt: skip
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert "max_output_tokens" in error["message"] and "max_tokens" not in error["message"]
        if asked == 0:
            assert error["param"] == "max_output_tokens"


def test_an_input_past_the_context_is_named_input(live):
    """Responses runs as chat, whose context check names messages; its client sent input."""
    too_long = {"model": MODEL, "input": "the cat sat on the mat " * 300, "max_output_tokens": 8}
    response = httpx.post(live.v1 + "/responses", json=too_long)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("context_length_exceeded", "input"), error


def test_retrieving_a_response_as_a_stream_is_refused(client):
    """The client's responses.retrieve(id, stream=True) asks for the events again (OpenAI
    replays a background response's): not kept here, so a 400, never JSON that the client's
    stream reads as no events at all."""
    response = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="stream"):
        list(client.responses.retrieve(response.id, stream=True))
    assert client.responses.retrieve(response.id).id == response.id
