"""The agents' APIs' pure parts: Responses items and Anthropic blocks to chat messages, their
tools and formats in chat's shape, the one sampling-field table's names, and chat deltas to
output blocks."""

from __future__ import annotations

import pytest

from yaied.server.agent_output import Blocks, finish_kind
from yaied.server.errors import APIError
from yaied.server.messages_protocol import parse_anthropic
from yaied.server.responses_protocol import check_call_outputs, parse_responses

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}


def test_responses_items_become_chat_messages():
    req = parse_responses(
        {
            "input": [
                {"role": "developer", "content": "Be terse."},
                {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "w", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            ],
            "tools": [{"type": "function", "name": "w", "parameters": SCHEMA}],
            "max_output_tokens": 7,
            "temperature": 0.5,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": SCHEMA}},
        }
    )
    roles = [m["role"] for m in req.new_messages]
    assert roles == ["system", "user", "assistant", "tool"]
    assert [c["id"] for c in req.new_messages[2]["tool_calls"]] == ["c1", "c2"]
    parsed = req.parsed
    assert parsed.max_tokens == 7 and parsed.sampling == {"temperature": 0.5}
    assert parsed.tools.tools[0].name == "w" and parsed.tools.choice.mode == "auto"
    assert parsed.structured is not None and parsed.structured.kind == "json_schema"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "max_tokens": 5}, "max_tokens"),  # chat's name is not the Responses one
        ({"input": "x", "top_k": 5}, "top_k"),
        ({"input": "x", "stop": ["a"]}, "stop"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": [{"type": "item_reference", "id": 5}]}, "input[0].id"),
        (
            {
                "input": [
                    {"type": "function_call_output", "call_id": "c", "output": [{"type": "x"}]}
                ]
            },
            "input[0].output",
        ),
        ({"input": "x", "reasoning": {"effort": "huge"}}, "reasoning.effort"),
        ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"input": "x", "moderation": {"model": "m"}}, "moderation"),
        ({"input": "x", "context_management": [{"type": "compaction"}]}, "context_management"),
        ({"input": "x", "prompt_cache_retention": 24}, "prompt_cache_retention"),
        ({"input": "x", "metadata": {"k": 1}}, "metadata"),
        ({"input": "x", "max_tool_calls": 0}, "max_tool_calls"),
        ({"input": "x", "max_tool_calls": "3"}, "max_tool_calls"),
        # a conversation object without its id would run the turn with no history, unsaved
        ({"input": "x", "conversation": {}}, "conversation"),
        ({"input": "x", "conversation": {"conversation_id": "conv_1"}}, "conversation"),
        ({"input": "x", "conversation": {"id": 5}}, "conversation"),
        ({"input": "x", "conversation": {"id": None}}, "conversation"),
        # nested fields are named by their whole path, as the client spelled it
        ({"input": "x", "text": {"format": 5}}, "text.format"),
        ({"input": "x", "reasoning": {"summary": "long"}}, "reasoning.summary"),
    ],
)
def test_responses_refusals_name_the_field(body, param):
    with pytest.raises(APIError) as caught:
        parse_responses(body)
    assert caught.value.status == 400 and caught.value.param == param


def test_responses_newer_fields_are_accepted_where_they_ask_nothing():
    """The current SDK's cache hints and efforts: accepted (the prefix cache needs no hints;
    the effort goes to the template)."""
    req = parse_responses(
        {
            "input": "x",
            "prompt_cache_key": "k",
            "prompt_cache_retention": "24h",
            "prompt_cache_options": {"ttl": "1h"},
            "max_tool_calls": 4,
            "reasoning": {"effort": "xhigh", "summary": "auto", "context": "auto"},
        }
    )
    assert req.effort == "xhigh" and req.parsed.chat_template_kwargs["reasoning_effort"] == "xhigh"


def test_responses_input_items_keep_their_shape_and_ids():
    """What GET /v1/responses/{id}/input_items lists: every item in Responses' shape, the
    client's ids kept; a function call's output may be text parts."""
    req = parse_responses(
        {
            "input": [
                {"role": "developer", "content": "Be terse.", "id": "msg_mine"},
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1",
                 "output": [{"type": "input_text", "text": "sunny"}, {"type": "input_text",
                                                                      "text": "mild"}]},
            ]
        }
    )  # fmt: skip
    assert [item.get("id") for item in req.input_items] == ["msg_mine", "rs_1", None, None]
    assert req.input_items[0] == {
        "id": "msg_mine", "type": "message", "role": "developer", "status": "completed",
        "content": [{"type": "input_text", "text": "Be terse."}],
    }  # fmt: skip
    assert req.input_items[2] == {"type": "function_call", "call_id": "c1", "name": "w",
                                  "arguments": "{}", "status": "completed"}  # fmt: skip
    assert req.input_items[3]["output"] == req.new_messages[-1]["content"] == "sunny\nmild"
    text = parse_responses({"input": "Hi"}).input_items
    assert text == [{"type": "message", "role": "user", "status": "completed",
                     "content": [{"type": "input_text", "text": "Hi"}]}]  # fmt: skip


def test_responses_item_references_take_the_stored_items():
    """Codex-style clients send back an earlier output item by id alone (``item_reference``,
    or a bare ``{"id"}``): the resolver's item takes its place; an unknown id is a 404."""
    stored = {
        "fc_r1_0": {"type": "function_call", "id": "fc_r1_0", "call_id": "c1", "name": "w",
                    "arguments": '{"city": "Oslo"}', "status": "completed"},
        "msg_r1_1": {"type": "message", "id": "msg_r1_1", "role": "assistant", "status":
                     "completed", "content": [{"type": "output_text", "text": "Checking.",
                                               "annotations": []}]},
    }  # fmt: skip
    req = parse_responses(
        {
            "input": [
                {"role": "user", "content": "Weather in Oslo?"},
                {"id": "msg_r1_1"},
                {"type": "item_reference", "id": "fc_r1_0"},
                {"type": "function_call_output", "call_id": "c1", "output": "rain"},
            ]
        },
        stored.get,
    )
    assert [m["role"] for m in req.new_messages] == ["user", "assistant", "tool"]
    assistant = req.new_messages[1]
    assert assistant["content"] == "Checking." and assistant["tool_calls"][0]["id"] == "c1"
    assert [item["id"] for item in req.input_items[1:3]] == ["msg_r1_1", "fc_r1_0"]
    for resolve in (stored.get, None):
        with pytest.raises(APIError) as caught:
            parse_responses({"input": [{"type": "item_reference", "id": "fc_r9_0"}]}, resolve)
        assert caught.value.status == 404 and caught.value.param == "input[0]"


def test_a_call_output_must_answer_a_call_of_the_conversation():
    """OpenAI refuses a function_call_output whose call_id no function_call of the conversation
    (the stored history, or this input) carries: 400, param input, its message."""
    call = {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"}
    answer = {"type": "function_call_output", "call_id": "c1", "output": "sunny"}
    stray = {"type": "custom_tool_call_output", "call_id": "c9", "output": "?"}
    ask = {"role": "user", "content": "Weather?"}
    check_call_outputs([], parse_responses({"input": [ask, call, answer]}).new_messages)
    history = parse_responses({"input": [ask, call]}).new_messages  # a stored turn's calls
    check_call_outputs(history, parse_responses({"input": [answer]}).new_messages)
    for earlier, now in (([], [ask, answer]), (history, [answer, stray]), ([], [call, stray])):
        with pytest.raises(APIError) as caught:
            check_call_outputs(earlier, parse_responses({"input": now}).new_messages)
        error = caught.value
        assert error.status == 400 and error.param == "input", error
        missing = "c1" if now == [ask, answer] else "c9"
        text = f"No tool call found for function call output with call_id {missing}."
        assert error.message == text


def test_anthropic_blocks_become_chat_messages():
    req = parse_anthropic(
        {
            "max_tokens": 9,
            "system": [{"type": "text", "text": "Be terse."}],
            "stop_sequences": ["END"],
            "top_k": 3,
            "messages": [
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hm", "signature": ""},
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "t1", "name": "w", "input": {"city": "Paris"}},
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": [
                        {"type": "text", "text": "sunny"}]},
                    {"type": "text", "text": "Thanks."},
                ]},
            ],
            "tools": [{"name": "w", "input_schema": SCHEMA}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        }
    )  # fmt: skip
    messages = req.parsed.messages
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "user"]
    call = messages[2]["tool_calls"][0]
    assert call["function"]["arguments"] == '{"city":"Paris"}' and call["id"] == "t1"
    assert messages[3] == {"role": "tool", "tool_call_id": "t1", "content": "sunny"}
    tools = req.parsed.tools
    assert tools.choice.mode == "required" and tools.parallel is False
    assert req.parsed.max_tokens == 9 and req.stop_sequences == ("END",)
    assert req.parsed.sampling["top_k"] == 3


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        ({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
        ({"max_tokens": 1, "messages": [{"role": "user", "content": [
            {"type": "tool_use", "id": "a", "name": "w", "input": {}}]}]},
         "messages[0].content[0]"),
        ({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
          "tool_choice": {"type": "sometimes"}}, "tool_choice"),
        ({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
          "mcp_servers": []}, "mcp_servers"),
        ({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
          "metadata": {"user_id": 7}}, "metadata.user_id"),
        ({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
          "thinking": {"type": "sometimes"}}, "thinking.type"),
        ({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
          "thinking": {"type": "adaptive", "display": "full"}}, "thinking"),
        ({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
          "thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
        ({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
          "thinking": {"type": "enabled", "budget_tokens": "lots"}}, "thinking.budget_tokens"),
        ({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
          "thinking": {"type": "enabled", "budget_tokens": 100}}, "thinking.budget_tokens"),
        ({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
          "thinking": {"type": "adaptive", "budget_tokens": True}}, "thinking.budget_tokens"),
        ({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
          "context_management": {"edits": [{"type": "nope"}]}},
         "context_management.edits[0].type"),
        ({"max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "document",
          "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBE"}}]}]},
         "messages[0].content[0].source"),
    ],
)  # fmt: skip
def test_anthropic_refusals_name_the_field(body, param):
    with pytest.raises(APIError) as caught:
        parse_anthropic(body)
    assert caught.value.status == 400 and caught.value.param == param


def test_a_last_assistant_message_is_a_prefill():
    ask = {"role": "user", "content": "A JSON object, please."}
    body = {"max_tokens": 8, "messages": [ask, {"role": "assistant", "content": '{"a":'}]}
    parsed = parse_anthropic(body).parsed
    assert parsed.continue_final_message and not parsed.add_generation_prompt
    assert parsed.messages[-1] == {"role": "assistant", "content": '{"a":'}
    assert not parse_anthropic({**body, "messages": [ask]}).parsed.continue_final_message
    # Anthropic's own rule, and the grammars a prefill would contradict
    spaced = {**body, "messages": [ask, {"role": "assistant", "content": "Sure, "}]}
    with pytest.raises(APIError, match="trailing whitespace"):
        parse_anthropic(spaced)
    tool = {"name": "w", "input_schema": {"type": "object"}}
    forced = {**body, "tools": [tool], "tool_choice": {"type": "any"}}
    with pytest.raises(APIError, match="forced tool call") as caught:
        parse_anthropic(forced)
    assert caught.value.param == "messages"
    # a tool choice that lets the model write text first goes with a prefill
    assert parse_anthropic({**forced, "tool_choice": {"type": "auto"}}).parsed.tools.active


def test_blocks_follow_the_order_the_model_wrote():
    blocks = Blocks()
    events = blocks.feed(
        [
            {"reasoning_content": "think", "reasoning": "think"},
            {"content": "Hello "},
            {"content": "there"},
            {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                             "function": {"name": "w", "arguments": ""}}]},
            {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
            {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]},
        ]
    )  # fmt: skip
    events += blocks.close()
    actions = [(e.action, e.block.kind) for e in events]
    assert actions == [
        ("start", "reasoning"), ("delta", "reasoning"), ("stop", "reasoning"),
        ("start", "text"), ("delta", "text"), ("delta", "text"), ("stop", "text"),
        ("start", "tool_call"), ("delta", "tool_call"), ("delta", "tool_call"),
        ("stop", "tool_call"),
    ]  # fmt: skip
    kinds = [(b.kind, b.text) for b in blocks.blocks]
    assert kinds == [("reasoning", "think"), ("text", "Hello there"),
                     ("tool_call", '{"city": "Paris"}')]  # fmt: skip
    assert blocks.blocks[2].call_id == "call_1" and blocks.blocks[2].name == "w"
    assert finish_kind("stop", blocks.blocks) == "tool_calls"
    assert finish_kind("length", blocks.blocks) == "length"


def test_the_agents_sampling_fields_come_from_the_one_table():
    """Each agent API takes exactly the table's names for it, and its OpenAPI schema lists them."""
    from yaied.core.sampling_fields import request_names
    from yaied.server.openapi_agents import agent_paths

    responses, messages = request_names("responses"), request_names("messages")
    assert responses == {"max_output_tokens", "temperature", "top_p", "top_logprobs"}
    assert messages == {"max_tokens", "temperature", "top_p", "top_k", "stop_sequences"}
    paths = agent_paths()
    for path, names in (("/v1/responses", responses), ("/v1/messages", messages)):
        schema = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert names <= set(schema["properties"])
    values = {"max_output_tokens": 5, "max_tokens": 5, "temperature": 0.5, "top_p": 0.9,
              "top_k": 3, "stop_sequences": ["x"], "top_logprobs": 2}  # fmt: skip
    req = parse_responses({"input": "x", **{n: values[n] for n in responses}})
    assert req.parsed.max_tokens == 5 and req.parsed.sampling == {"temperature": 0.5, "top_p": 0.9}
    assert req.parsed.logprobs == 2
    chat = parse_anthropic(
        {"messages": [{"role": "user", "content": "x"}], **{n: values[n] for n in messages}}
    ).parsed
    assert chat.max_tokens == 5
    assert chat.sampling == {"temperature": 0.5, "top_p": 0.9, "top_k": 3, "stop": ["x"]}


@pytest.mark.parametrize(
    ("thinking", "enabled", "omitted"),
    [
        ({"type": "enabled", "budget_tokens": 1024}, True, False),
        ({"type": "adaptive"}, True, False),
        ({"type": "between_tools", "display": "summarized"}, True, False),
        ({"type": "adaptive", "display": "omitted"}, True, True),
        ({"type": "disabled"}, False, False),
    ],
)
def test_anthropic_thinking_types_switch_the_templates_thinking(thinking, enabled, omitted):
    """The current SDK's thinking types: each one but disabled has the model think (the
    template's enable_thinking); display omitted keeps the blocks and leaves their text out."""
    body = {"max_tokens": 9, "messages": [{"role": "user", "content": "x"}], "thinking": thinking}
    req = parse_anthropic(body)
    assert req.parsed.chat_template_kwargs == {"enable_thinking": enabled}
    assert req.omit_thinking is omitted


def test_omitted_thinking_keeps_its_blocks_without_their_text():
    from yaied.server.messages_api import _block_body, _shown

    blocks = Blocks()
    events = blocks.feed([{"reasoning_content": "let me see"}, {"content": "Hi"}])
    events += blocks.close()
    req = parse_anthropic({"max_tokens": 9, "messages": [{"role": "user", "content": "x"}],
                           "thinking": {"type": "adaptive", "display": "omitted"}})  # fmt: skip
    sent = [(e.action, e.block.kind) for e in events if _shown(e, req)]
    assert ("delta", "reasoning") not in sent and ("start", "reasoning") in sent
    assert ("delta", "text") in sent
    thinking = _block_body(blocks.blocks[0], omit_thinking=True)
    assert thinking == {"type": "thinking", "thinking": "", "signature": ""}
    assert _block_body(blocks.blocks[0])["thinking"] == "let me see"


def test_responses_custom_tools_are_functions_of_one_string():
    """A custom tool is shown as a function with one string parameter; a regex format holds
    its JSON-escaped input; its earlier calls and outputs are the function's."""
    req = parse_responses(
        {
            "input": [
                {"role": "user", "content": "Patch it."},
                {"type": "custom_tool_call", "call_id": "c1", "name": "patch", "input": 'a "b"'},
                {"type": "custom_tool_call_output", "call_id": "c1", "output": "ok"},
            ],
            "tools": [
                {"type": "custom", "name": "patch", "description": "Applies a patch"},
                {"type": "custom", "name": "sql", "format": {"type": "grammar",
                 "syntax": "regex", "definition": "SELECT [a-z]+;"}},
                {"type": "function", "name": "w", "parameters": SCHEMA},
            ],
            "tool_choice": {"type": "custom", "name": "sql"},
        }
    )  # fmt: skip
    assert req.custom_tools == {"patch", "sql"}
    tools = {tool.name: tool for tool in req.parsed.tools.tools}
    assert tools["patch"].parameters["properties"] == {"input": {"type": "string"}}
    assert tools["patch"].input_regex is None and tools["w"].input_regex is None
    assert tools["sql"].input_regex == "SELECT ([a-z])+;"
    assert req.parsed.tools.choice.name == "sql"
    call = req.new_messages[1]["tool_calls"][0]["function"]
    assert call == {"name": "patch", "arguments": '{"input": "a \\"b\\""}'}
    assert req.new_messages[2] == {"role": "tool", "tool_call_id": "c1", "content": "ok"}
    kinds = [item["type"] for item in req.input_items]
    assert kinds == ["message", "custom_tool_call", "custom_tool_call_output"]
    assert req.input_items[1]["input"] == 'a "b"'


@pytest.mark.parametrize(
    ("tool", "param"),
    [
        (
            {"format": {"type": "grammar", "syntax": "lark", "definition": "start: x"}},
            "tools[0].format",
        ),
        (
            {"format": {"type": "grammar", "syntax": "regex", "definition": "(a)\\1"}},
            "tools[0].format",
        ),
        ({"format": {"type": "grammar", "syntax": "regex"}}, "tools[0].format"),
        ({"format": {"type": "json"}}, "tools[0].format"),
        ({"description": 5}, "tools[0].description"),
        ({"name": "two words"}, "tools[0].name"),
    ],
)
def test_responses_bad_custom_tools_are_refused(tool, param):
    with pytest.raises(APIError) as caught:
        parse_responses({"input": "x", "tools": [{"type": "custom", "name": "t", **tool}]})
    assert caught.value.status == 400 and caught.value.param == param


def test_anthropic_text_documents_are_read_as_text():
    """A document whose source is text (plain, or content blocks) is its title, its context
    and its text, in the user's message with the question beside it."""
    req = parse_anthropic(
        {
            "max_tokens": 5,
            "messages": [{"role": "user", "content": [
                {"type": "document", "title": "Notes", "context": "from the wiki",
                 "source": {"type": "text", "media_type": "text/plain", "data": "Pay day: 25th."}},
                {"type": "document", "source": {"type": "content", "content": [
                    {"type": "text", "text": "Part one."}, {"type": "text", "text": "Part two."}]}},
                {"type": "text", "text": "When is pay day?"},
            ]}],
        }
    )  # fmt: skip
    assert req.parsed.messages == [
        {
            "role": "user",
            "content": "Notes\n\nfrom the wiki\n\nPay day: 25th.\nPart one.\nPart two.\n"
            "When is pay day?",
        }
    ]


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"}}


@pytest.mark.parametrize(
    ("content", "param", "words"),
    [
        ([IMAGE, {"type": "text", "text": "What is it?"}], "messages[0].content[0]",
         "image blocks are not supported"),
        ([{"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}],
         "messages[0].content[0]", "image blocks are not supported"),
        ([{"type": "tool_result", "tool_use_id": "toolu_1", "content": [IMAGE]}],
         "messages[0].content[0].content[0]", "image blocks are not supported"),
        ([{"type": "search_result", "source": "s", "title": "t", "content": []}],
         "messages[0].content[0]", "search_result blocks are not supported"),
        ([7], "messages[0].content[0]", "must be an object with a type"),
        ([{"text": "no type"}], "messages[0].content[0]", "must be an object with a type"),
    ],
)  # fmt: skip
def test_anthropic_blocks_the_model_cannot_read_are_clear_400s(content, param, words):
    body = {"messages": [{"role": "user", "content": content}]}
    for count_only in (False, True):  # count_tokens refuses them as create does
        asked = body if count_only else {**body, "max_tokens": 5}
        with pytest.raises(APIError) as caught:
            parse_anthropic(asked, count_only=count_only)
        assert caught.value.status == 400 and caught.value.param == param
        assert words in caught.value.message, caught.value.message


def _use(call_id):
    return {"type": "tool_use", "id": call_id, "name": "w", "input": {}}


def _result(call_id, **extra):
    return {"type": "tool_result", "tool_use_id": call_id, "content": "ok", **extra}


ASK_ONE = {"role": "user", "content": "Weather?"}


@pytest.mark.parametrize(
    ("messages", "param", "words"),
    [
        # a result for a call nobody made (a typo, a stale id): Anthropic answers a 400
        ([ASK_ONE, {"role": "assistant", "content": [_use("t1")]},
          {"role": "user", "content": [_result("t1"), _result("t9")]}],
         "messages[2].content[1]", "'t9'"),
        # a result in the first message: no tool_use precedes it
        ([{"role": "user", "content": [_result("t1")]}], "messages[0].content[0]", "'t1'"),
        # a result two turns after its call: it must follow the assistant turn right before
        ([ASK_ONE, {"role": "assistant", "content": [_use("t1")]},
          {"role": "user", "content": [_result("t1")]}, {"role": "assistant", "content": "ok"},
          {"role": "user", "content": [_result("t1")]}], "messages[4].content[0]", "'t1'"),
        # a call left unanswered by the user turn after it
        ([ASK_ONE, {"role": "assistant", "content": [_use("t1"), _use("t2")]},
          {"role": "user", "content": [_result("t2")]}], "messages[1].content[0]", "'t1'"),
        ([ASK_ONE, {"role": "assistant", "content": [_use("t1")]},
          {"role": "user", "content": "and then?"}], "messages[1].content[0]", "'t1'"),
        # two calls of one turn with one id: a result could not say which it answers
        ([ASK_ONE, {"role": "assistant", "content": [_use("t1"), _use("t1")]},
          {"role": "user", "content": [_result("t1")]}], "messages[1].content[1]", "twice"),
    ],
)  # fmt: skip
def test_tool_results_and_tool_uses_must_pair_up(messages, param, words):
    with pytest.raises(APIError) as caught:
        parse_anthropic({"max_tokens": 4, "messages": messages})
    assert caught.value.status == 400 and caught.value.param == param
    assert words in caught.value.message and param in caught.value.message


def test_consecutive_messages_of_one_role_are_one_turn():
    """Anthropic combines consecutive same-role messages: two user messages read as one (so a
    template that wants alternating roles gets them), and the results of one assistant turn's
    parallel calls may come back in two user messages, error results and text blocks alike."""
    body = {"max_tokens": 4, "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "user", "content": [{"type": "text", "text": "In Paris and Rome."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Looking."}]},
        {"role": "assistant", "content": [_use("a"), _use("b")]},
        {"role": "user", "content": [_result("a")]},
        {"role": "user", "content": [
            _result("b", is_error=True, content=[{"type": "text", "text": "down"}]),
            {"type": "text", "text": "Go on."}]},
    ]}  # fmt: skip
    messages = parse_anthropic(body).parsed.messages
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool", "user"]
    assert messages[0]["content"] == "Weather?\nIn Paris and Rome."
    assert messages[1]["content"] == "Looking."
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["a", "b"]
    assert messages[3] == {"role": "tool", "tool_call_id": "b", "content": "Error: down"}
    assert messages[4]["content"] == "Go on."
    # two assistant messages at the end are one prefill
    prefill = parse_anthropic({"max_tokens": 4, "messages": [
        {"role": "user", "content": "JSON?"}, {"role": "assistant", "content": "{"},
        {"role": "assistant", "content": '"a":'}]}).parsed  # fmt: skip
    assert prefill.continue_final_message and prefill.messages[-1]["content"] == '{\n"a":'


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
         "messages[0].content[0]", "messages[0].content[0].text must be a string"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]},
         "messages[0].content[0]", "messages[0].content[0].text must be a string"),
        ({"stop_sequences": ["END", ""]}, "stop_sequences", "stop_sequences must be non-empty"),
        ({"stop_sequences": [f"s{i}" for i in range(17)]}, "stop_sequences",
         "stop_sequences may hold at most 16"),
        ({"tools": [{"input_schema": {"type": "object"}}]}, "tools[0].name", "tools[0].name"),
        ({"tools": [{"name": "w", "input_schema": "x"}]}, "tools[0].input_schema",
         "tools[0].input_schema is required (a JSON schema object)"),
    ],
)  # fmt: skip
def test_anthropic_refusals_use_the_messages_apis_names(extra, param, words):
    """Not chat's names (``stop``, ``tools[0].function.name``) nor a misleading reason (a
    user message "cannot hold a 'text' block")."""
    body = {"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], **extra}
    with pytest.raises(APIError) as caught:
        parse_anthropic(body)
    assert caught.value.status == 400 and caught.value.param == param
    assert words in caught.value.message, caught.value.message
