"""Generated messages: prose with near-markup and calls with awkward arguments, written by the
format spec itself, parsed back from random cuts."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.tools.test_parser import MARKUP, stream, summary
from yaied.tools import ToolCallArguments, ToolCallEnd, ToolCallParser, get_format

# Pieces that look like markup without being it, so hold-back is exercised.
_PROSE_PIECES = ["a", "Z", " ", "\n", "<", ">", "/", "{", "}", ";", '"', "<tool", "_call", "<|py"]
_STRING_CHARS = st.sampled_from(list('ab "\\/{}[]<>;:,\n\té☀') + ["</tool_call>", "<tool_call>"])

json_strings = st.lists(_STRING_CHARS, max_size=12).map("".join)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**6), 10**6)
    | st.floats(allow_nan=False, allow_infinity=False)
    | json_strings,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(json_strings, inner, max_size=3),
    max_leaves=8,
)
arguments = st.dictionaries(json_strings, json_values, max_size=4)
names = st.from_regex(r"[a-z_][a-z0-9_]{0,10}", fullmatch=True)
calls = st.lists(st.tuples(names, arguments), min_size=1, max_size=3)
prose = (
    st.lists(st.sampled_from(_PROSE_PIECES), max_size=15)
    .map(lambda pieces: "".join(pieces).strip())
    .filter(lambda text: not any(m in text for m in MARKUP))
)


def cut(text: str, sizes: list[int]) -> list[str]:
    pieces, i = [], 0
    for n in sizes:
        pieces.append(text[i : i + n])
        i += n
    return [*pieces, text[i:]]


cuts = st.lists(st.integers(0, 7), max_size=200)


@settings(max_examples=150, deadline=None)
@given(before=prose, calls=calls, sizes=cuts, streamed=st.booleans())
def test_hermes_recovers_generated_calls(before, calls, sizes, streamed):
    """Buffered or streamed arguments (`stream` checks that the fragments add up)."""
    text = (before + "\n" if before else "") + get_format("hermes").render_calls(calls)
    expected = (before or None, [(n, json.loads(json.dumps(a))) for n, a in calls])
    for pieces in ([text], cut(text, sizes), list(text)):
        message = stream("hermes", pieces, stream_arguments=streamed)
        assert summary(message) == expected and not message.errors


@settings(max_examples=150, deadline=None)
@given(calls=calls, tag=st.booleans(), sizes=cuts, streamed=st.booleans())
def test_llama3_json_recovers_generated_calls(calls, tag, sizes, streamed):
    text = ("<|python_tag|>" if tag else "") + get_format("llama3_json").render_calls(calls)
    expected = (None, [(n, json.loads(json.dumps(a))) for n, a in calls])
    for pieces in ([text], cut(text, sizes)):
        message = stream("llama3_json", pieces, stream_arguments=streamed)
        assert summary(message) == expected and not message.errors


@settings(max_examples=150, deadline=None)
@given(text=prose, fmt=st.sampled_from(["hermes", "llama3_json"]), sizes=cuts)
def test_prose_without_calls_comes_out_unchanged(text, fmt, sizes):
    if fmt == "llama3_json" and text.startswith("{"):
        text = "x" + text  # a message opening with "{" may be a call: held, tested elsewhere
    for pieces in ([text], cut(text, sizes)):
        assert summary(stream(fmt, pieces)) == (text or None, [])


@settings(max_examples=100, deadline=None)
@given(calls=calls, sizes=cuts, keep=st.integers(0, 400))
def test_a_streamed_call_cut_short_keeps_what_was_sent(calls, sizes, keep):
    """The stream ends anywhere inside a streamed call (max_tokens): the call ends with the
    arguments sent so far (a prefix of the whole), noted as an error; none of it is content."""
    whole = get_format("hermes").render_calls(calls)
    head = whole.find('"arguments": ') + len('"arguments": ') + 1
    closing = whole.find("}\n</tool_call>", head)  # the call object's own brace (JSON escapes \n)
    text = whole[: head + keep % (closing - head + 1)]  # cut before it
    parser = ToolCallParser("hermes", stream_arguments=True)
    events = [e for piece in cut(text, sizes) for e in parser.feed(piece)] + parser.finish()
    message = parser.result()
    assert message.content is None and message.tool_calls and message.errors
    last = message.tool_calls[-1]
    index = len(message.tool_calls) - 1
    fragments = [e for e in events if isinstance(e, ToolCallArguments) and e.index == index]
    sent = "".join(e.fragment for e in fragments)
    assert sent == last.arguments_json and last.arguments_json in whole
    assert isinstance(events[-1], ToolCallEnd)


@settings(max_examples=100, deadline=None)
@given(before=prose, calls=calls, sizes=cuts, keep=st.integers(0, 400))
def test_a_streamed_call_cut_before_its_arguments_leaves_no_markup(before, calls, sizes, keep):
    """Under a grammar (stream_arguments) only max_tokens cuts a call short. Cut after its
    marker and before its arguments open (inside its name, say), the last call is dropped, noted
    as an error: none of its markup is content, and the calls before it stand."""
    render = get_format("hermes").render_calls
    earlier = (before + "\n" if before else "") + (render(calls[:-1]) + "\n" if calls[1:] else "")
    last = render(calls[-1:])
    assert earlier + last == (before + "\n" if before else "") + render(calls)
    marker = len("<tool_call>")
    head = last.find('"arguments": ') + len('"arguments": ')  # before its "{"
    text = earlier + last[: marker + keep % (head - marker + 1)]
    parser = ToolCallParser("hermes", stream_arguments=True)
    events = [e for piece in cut(text, sizes) for e in parser.feed(piece)] + parser.finish()
    message = parser.result()
    assert message.content == (before or None) and message.errors
    expected = [(n, json.loads(json.dumps(a))) for n, a in calls[:-1]]
    assert [(c.name, json.loads(c.arguments_json)) for c in message.tool_calls] == expected
    assert len([e for e in events if isinstance(e, ToolCallEnd)]) == len(expected)


_JUNK_PIECES = [*_PROSE_PIECES, "<tool_call>", "</tool_call>", '{"name": ', '"a\\x"', '"f"',
                ", ", '"arguments": ', '"parameters": ', "{", "}", '"', "\\", "[", "]", "1",
                "\n"]  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.sampled_from(_JUNK_PIECES), max_size=40), sizes=cuts,
       fmt=st.sampled_from(["hermes", "llama3_json"]))  # fmt: skip
def test_streamed_arguments_survive_any_text(pieces, sizes, fmt):
    """Whatever the model writes without a grammar (markup fragments, bad escapes, cut calls),
    the streaming parser raises nothing and every call's fragments add up to its arguments."""
    text = "".join(pieces)
    parser = ToolCallParser(fmt, stream_arguments=True)
    events = [e for piece in cut(text, sizes) for e in parser.feed(piece)] + parser.finish()
    message = parser.result()
    for index, call in enumerate(message.tool_calls):
        sent = [e.fragment for e in events if isinstance(e, ToolCallArguments) and e.index == index]
        assert "".join(sent) == call.arguments_json
    ends = [e for e in events if isinstance(e, ToolCallEnd)]
    assert len(ends) == len(message.tool_calls)
