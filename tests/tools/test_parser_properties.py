"""Generated messages: prose with near-markup and calls with awkward arguments, written by the
format spec itself, parsed back from random cuts."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.tools.test_parser import MARKUP, stream, summary
from yaied.tools import get_format

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
@given(before=prose, calls=calls, sizes=cuts)
def test_hermes_recovers_generated_calls(before, calls, sizes):
    text = (before + "\n" if before else "") + get_format("hermes").render_calls(calls)
    expected = (before or None, [(n, json.loads(json.dumps(a))) for n, a in calls])
    for pieces in ([text], cut(text, sizes), list(text)):
        message = stream("hermes", pieces)
        assert summary(message) == expected and not message.errors


@settings(max_examples=150, deadline=None)
@given(calls=calls, tag=st.booleans(), sizes=cuts)
def test_llama3_json_recovers_generated_calls(calls, tag, sizes):
    text = ("<|python_tag|>" if tag else "") + get_format("llama3_json").render_calls(calls)
    expected = (None, [(n, json.loads(json.dumps(a))) for n, a in calls])
    for pieces in ([text], cut(text, sizes)):
        message = stream("llama3_json", pieces)
        assert summary(message) == expected and not message.errors


@settings(max_examples=150, deadline=None)
@given(text=prose, fmt=st.sampled_from(["hermes", "llama3_json"]), sizes=cuts)
def test_prose_without_calls_comes_out_unchanged(text, fmt, sizes):
    if fmt == "llama3_json" and text.startswith("{"):
        text = "x" + text  # a message opening with "{" may be a call: held, tested elsewhere
    for pieces in ([text], cut(text, sizes)):
        assert summary(stream(fmt, pieces)) == (text or None, [])
