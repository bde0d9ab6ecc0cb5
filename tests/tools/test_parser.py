"""The streaming tool-call parser on synthetic outputs of each format: the content and calls it
recovers are the same wherever the deltas are cut, and the events add up to the final message."""

from __future__ import annotations

import itertools
import json

import pytest

from tests.tools.splitting import splits
from yaied.tools import (
    ContentDelta,
    ParsedMessage,
    ToolCallArguments,
    ToolCallEnd,
    ToolCallParser,
    ToolCallStart,
    finish_reason,
    new_call_id,
    parse_tool_calls,
)

MARKUP = ("<tool_call>", "</tool_call>", "<|python_tag|>")


def stream(fmt: str, pieces: list[str], **kwargs) -> ParsedMessage:
    """Feed `pieces`, check the events against the final message, return the message."""
    counter = itertools.count()
    parser = ToolCallParser(fmt, id_factory=lambda: f"call_{next(counter)}", **kwargs)
    events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish()
    message = parser.result()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    assert content == (message.content or "")
    assert all(e.text for e in events if isinstance(e, ContentDelta))  # no empty deltas
    # Per call: start, argument fragments, end, in that order, adding up to the final call.
    calls = []
    for e in events:
        if isinstance(e, ToolCallStart):
            assert e.index == len(calls)
            calls.append([e.id, e.name, "", False])
        elif isinstance(e, ToolCallArguments):
            assert e.index == len(calls) - 1 and not calls[-1][3]
            calls[-1][2] += e.fragment
        elif isinstance(e, ToolCallEnd):
            assert e.index == len(calls) - 1
            calls[-1][3] = True
    assert all(done for *_, done in calls)
    assert [(i, n, a) for i, n, a, _ in calls] == [
        (c.id, c.name, c.arguments_json) for c in message.tool_calls
    ]
    for call in message.tool_calls:
        assert isinstance(json.loads(call.arguments_json), dict)
    return message


def summary(message: ParsedMessage) -> tuple:
    calls = [(c.name, json.loads(c.arguments_json)) for c in message.tool_calls]
    return message.content, calls


def check_every_split(fmt: str, text: str, content, calls, *, errors: bool = False, **kwargs):
    """The expected message whatever the cuts; the same ids too, since they come in order."""
    whole = stream(fmt, [text], **kwargs)
    assert summary(whole) == (content, calls)
    assert bool(whole.errors) == errors, whole.errors
    for pieces in splits(text):
        assert stream(fmt, pieces, **kwargs) == whole, pieces
    if not errors and content is not None:
        assert not any(m in content for m in MARKUP)


WEATHER = {"city": "Paris", "unit": "celsius"}
TRICKY = {"text": 'a </tool_call> b <tool_call> {"}" \\ \n ; }}', "n": None, "k": {"}": "{"}}


def hermes(name: str, arguments) -> str:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


@pytest.mark.parametrize(
    "text, content, calls",
    [
        pytest.param(
            "Let me check the weather.\n" + hermes("get_weather", WEATHER),
            "Let me check the weather.",
            [("get_weather", WEATHER)],
            id="text-before-call",
        ),
        pytest.param(hermes("get_weather", WEATHER), None, [("get_weather", WEATHER)], id="call"),
        pytest.param(hermes("now", {}), None, [("now", {})], id="no-arguments"),
        pytest.param(
            '<tool_call>\n{"name": "now"}\n</tool_call>', None, [("now", {})], id="no-key"
        ),
        pytest.param(
            hermes("a", {"x": 1}) + "\n" + hermes("b", {}) + "\n\n" + hermes("c", {"y": [1, 2]}),
            None,
            [("a", {"x": 1}), ("b", {}), ("c", {"y": [1, 2]})],
            id="several-calls",
        ),
        pytest.param(
            hermes("echo", TRICKY),
            None,
            [("echo", TRICKY)],
            id="markup-inside-a-json-string",
        ),
        pytest.param(
            "Checking both.  " + hermes("a", {}) + hermes("b", {}) + "\nDone, see above.\n",
            "Checking both.\nDone, see above.",
            [("a", {}), ("b", {})],
            id="text-after-calls",
        ),
        pytest.param(
            hermes("say", {"text": "Zürich ☀️ 東京"}),
            None,
            [("say", {"text": "Zürich ☀️ 東京"})],
            id="unicode",
        ),
        pytest.param(
            hermes("code", '{"src": "line 1\nline 2\ttab"}'),
            None,
            [("code", {"src": "line 1\nline 2\ttab"})],
            id="raw-control-characters-in-a-string",
        ),
        pytest.param(
            hermes("f", '"{\\"q\\": 1}"'), None, [("f", {"q": 1})], id="arguments-as-a-json-string"
        ),
        pytest.param(
            "1 < 2 and <tool_cal is no tag; <tool_call is none either\n",
            "1 < 2 and <tool_cal is no tag; <tool_call is none either\n",
            [],
            id="plain-text-with-near-markup",
        ),
        pytest.param("\n  Hello  \n", "\n  Hello  \n", [], id="plain-text-kept-exactly"),
        pytest.param("Hi <tool_", "Hi <tool_", [], id="partial-trigger-at-the-end"),
    ],
)
def test_hermes_every_split(text, content, calls):
    check_every_split("hermes", text, content, calls)


@pytest.mark.parametrize(
    "text, content, calls",
    [
        pytest.param(
            'Try: <tool_call>\n{"name": "f", "arguments": {"a": 1</tool_call> then '
            + hermes("g", {}),
            'Try: <tool_call>\n{"name": "f", "arguments": {"a": 1</tool_call> then',
            [("g", {})],
            id="invalid-json-then-a-good-call",
        ),
        pytest.param(
            "<tool_call>\nget_weather(city='Paris')\n</tool_call>",
            "<tool_call>\nget_weather(city='Paris')\n</tool_call>",
            [],
            id="not-json",
        ),
        pytest.param(
            '<tool_call>\n{"arguments": {}}\n</tool_call>',
            '<tool_call>\n{"arguments": {}}\n</tool_call>',
            [],
            id="no-name",
        ),
        pytest.param(
            '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',
            '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',
            [],
            id="arguments-not-an-object",
        ),
        pytest.param(
            '<tool_call>\n{"name": "f", "arguments": {"x": NaN}}\n</tool_call>',
            '<tool_call>\n{"name": "f", "arguments": {"x": NaN}}\n</tool_call>',
            [],
            id="nan-is-not-json",
        ),
        pytest.param(
            'Sure. <tool_call>\n{"name": "f", "arguments": {"a": "cut',
            'Sure. <tool_call>\n{"name": "f", "arguments": {"a": "cut',
            [],
            id="cut-off-inside-the-call",
        ),
        pytest.param("<tool_call>\n", "<tool_call>\n", [], id="cut-off-after-the-marker"),
    ],
)
def test_hermes_malformed_calls_are_content(text, content, calls):
    check_every_split("hermes", text, content, calls, errors=True)


@pytest.mark.parametrize(
    "text, content, calls, errors",
    [
        pytest.param("<tool_c", None, [], True, id="the-marker-cut-opens-the-message"),
        pytest.param(
            hermes("a", {}) + "\n<tool", None, [("a", {})], True, id="the-marker-cut-after-a-call"
        ),
        pytest.param("Sure <tool_c", "Sure <tool_c", [], False, id="after-prose-it-may-be-prose"),
    ],
)
def test_a_forced_call_cut_inside_its_marker_is_no_content(text, content, calls, errors):
    """Under the tool grammar (stream_arguments) text where a call may open holds only calls, so
    a stream that ends inside the marker there was cut by max_tokens: the markup is dropped."""
    check_every_split("hermes", text, content, calls, errors=errors, stream_arguments=True)


def test_hermes_sloppy_endings_keep_the_call():
    # An extra brace before </tool_call> is dropped; a missing </tool_call> is tolerated.
    text = hermes("a", {}).replace("}\n</tool_call>", "}}\n</tool_call>") + "ok"
    check_every_split("hermes", text, "ok", [("a", {})], errors=True)
    text = '<tool_call>{"name": "a", "arguments": {}}<tool_call>{"name": "b", "arguments": {}}'
    check_every_split("hermes", text, None, [("a", {}), ("b", {})], errors=True)


def test_unknown_function_names_are_content_when_names_are_given():
    text = hermes("rm_rf", {}) + hermes("get_weather", WEATHER)
    names = ["get_weather"]
    message = parse_tool_calls(text, tool_names=names)
    assert summary(message) == (hermes("rm_rf", {}), [("get_weather", WEATHER)])
    check_every_split("hermes", text, *summary(message), errors=True, tool_names=names)


def llama(name: str, arguments, key: str = "parameters") -> str:
    return json.dumps({"name": name, key: arguments})


@pytest.mark.parametrize(
    "text, content, calls",
    [
        pytest.param(llama("get_weather", WEATHER), None, [("get_weather", WEATHER)], id="call"),
        pytest.param(
            "<|python_tag|>" + llama("get_weather", WEATHER),
            None,
            [("get_weather", WEATHER)],
            id="python-tag",
        ),
        pytest.param(
            "\n " + llama("f", {"x": 1}, key="arguments"),
            None,
            [("f", {"x": 1})],
            id="arguments-key-and-leading-space",
        ),
        pytest.param(llama("now", {}), None, [("now", {})], id="no-arguments"),
        pytest.param(
            llama("a", {"s": "x; y } {"}) + "; " + llama("b", {}) + ";" + llama("c", {"n": 2}),
            None,
            [("a", {"s": "x; y } {"}), ("b", {}), ("c", {"n": 2})],
            id="several-calls",
        ),
        pytest.param(llama("a", {}) + "\n" + llama("b", {}), None, [("a", {}), ("b", {})], id="nl"),
        pytest.param(llama("a", {}) + ";", None, [("a", {})], id="trailing-separator"),
        pytest.param(
            llama("a", {}) + "\nThat is all.", "That is all.", [("a", {})], id="text-after"
        ),
        pytest.param(
            "I will call it: <|python_tag|>" + llama("a", {}),
            "I will call it:",
            [("a", {})],
            id="text-then-python-tag",
        ),
        pytest.param(
            "The set {1, 2} is small.", "The set {1, 2} is small.", [], id="prose-with-braces"
        ),
        pytest.param(
            ' {"answer": 42, "why": "name"}\n',
            ' {"answer": 42, "why": "name"}\n',
            [],
            id="json-answer-is-content",
        ),
        pytest.param('{"answer": [1, 2', '{"answer": [1, 2', [], id="cut-json-answer"),
    ],
)
def test_llama3_json_every_split(text, content, calls):
    check_every_split("llama3_json", text, content, calls)


def test_llama3_json_malformed_second_call_is_content():
    text = llama("a", {}) + '; {"name": "b", "parameters": {"x": tru}}'
    check_every_split(
        "llama3_json", text, '; {"name": "b", "parameters": {"x": tru}}', [("a", {})], errors=True
    )


def test_finish_reason():
    called = parse_tool_calls(hermes("a", {}))
    assert finish_reason(called, "stop") == "tool_calls"
    assert finish_reason(called, "length") == "length"  # a cut output stays visible as cut
    assert finish_reason(parse_tool_calls("hi"), "stop") == "stop"


def test_ids_are_openai_shaped_and_distinct():
    message = parse_tool_calls(hermes("a", {}) + hermes("b", {}))
    ids = [c.id for c in message.tool_calls]
    assert len(set(ids)) == 2
    assert all(i.startswith("call_") and len(i) == 29 and i[5:].isalnum() for i in ids)
    assert new_call_id() != new_call_id()


def test_feed_after_finish_is_an_error():
    parser = ToolCallParser("hermes")
    parser.finish()
    assert parser.finish() == []
    with pytest.raises(RuntimeError):
        parser.feed("x")


def test_content_is_released_as_soon_as_it_is_certain():
    parser = ToolCallParser("hermes")
    assert parser.feed("Hello <tool") == [ContentDelta("Hello")]
    assert parser.feed("box> ") == [ContentDelta(" <toolbox>")]
    events = parser.feed('<tool_call>{"name": "f", "arguments": {"a": 1}}')
    assert [type(e) for e in events] == [ToolCallStart, ToolCallArguments, ToolCallEnd]
    assert events[1].fragment == '{"a": 1}'
    assert parser.feed("</tool_call>") == [] and parser.finish() == []
