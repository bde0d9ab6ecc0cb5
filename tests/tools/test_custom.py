"""Free-form tools' regexes over JSON-escaped text: for each pattern, a string's JSON encoding
is accepted by the rewritten pattern (compiled by xgrammar, as the call's grammar is) exactly
when Python's re matches the string itself."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from yaied.tools.custom import InputStream, arguments_of, input_of, json_string_regex

xgr = pytest.importorskip("xgrammar")

# one token per character: the matcher then reads any string a character at a time
VOCAB = [chr(i) for i in range(32, 127)] + ["\n", "\t", "\x01", "é", "€", "😀"]
CASES = [
    (r"SELECT [a-z_]+ FROM [a-z_]+;", ["SELECT ab FROM cd;"], ["SELECT AB FROM cd;", "SELECT"]),
    ('say "hi"\n', ['say "hi"\n'], ["say hi\n", 'say "hi"']),
    (r"a[^x]b", ['a"b', "a\nb", "a\\b", "aéb", "a😀b", "a\x01b"], ["axb", "ab", 'a""b']),
    (r"a.b", ['a"b', "a\\b", "a\tb", "a€b"], ["a\nb", "ab"]),
    (r"^\d{3}-\w+\s\S$", ["123-ab_9 x", "123-a\tq", '123-a "'], ["12-ab x", "123-ab  "]),
    (r"(foo|ba[rz])+\n?", ["foo", "barbaz\n", "foobar"], ["fo", "bar\n\n"]),
    (r"[\n\"\\]*", ['\n"\\', ""], ["a"]),
    (r"x[^\d]{2,3}", ['x\n"', "xab", 'x"é\t'], ["x1a", "xa", "xabcd"]),
    (r"[\W]+", [' -"', "\\"], ["a", "_"]),
]


@pytest.fixture(scope="module")
def compiler():
    return xgr.GrammarCompiler(xgr.TokenizerInfo(VOCAB))


@pytest.mark.parametrize(("pattern", "matching", "other"), CASES)
def test_a_json_string_is_accepted_when_its_value_matches(compiler, pattern, matching, other):
    compiled = compiler.compile_grammar(
        xgr.Grammar.from_regex('"' + json_string_regex(pattern) + '"')
    )
    for text in matching + other:
        assert bool(re.fullmatch(pattern, text)) == (text in matching), text
        matcher = xgr.GrammarMatcher(compiled)
        encoded = json.dumps(text, ensure_ascii=False)
        assert matcher.accept_string(encoded) == (text in matching), (pattern, encoded)


@pytest.mark.parametrize(
    "pattern",
    [r"(a)\1", r"(?=a)a", r"a\bb", r"(", r"[^\s\S]", r"(?i)ab", r"a(?s:.)", r"a{4294967296}",
     r"a{1001}", "(" * 400 + "a" + ")" * 400],
)  # fmt: skip
def test_patterns_it_cannot_rewrite_are_refused(pattern):
    with pytest.raises(ValueError):
        json_string_regex(pattern)


def test_a_calls_input_round_trips_through_its_arguments():
    text = 'line 1\n"quoted" \\ é'
    assert input_of(arguments_of(text)) == text
    assert input_of("not json") == "not json"  # what the model wrote, rather than nothing
    assert input_of('{"input": "SELECT \\"a') == 'SELECT "a'  # a call cut short: its part
    assert input_of('{"other": 1}') == '{"other": 1}'


REGEX_ALPHABET = 'ab"\\\n.[]^-()|*+?{},0123$\\dDwWsS'


@settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(pattern=st.text(alphabet=REGEX_ALPHABET, max_size=12))
def test_any_pattern_is_rewritten_or_refused(compiler, pattern):
    """Whatever a client sends: a ValueError (the server's 400), or a regex xgrammar compiles."""
    try:
        rewritten = json_string_regex(pattern)
    except ValueError:
        return
    compiler.compile_grammar(xgr.Grammar.from_regex('"' + rewritten + '"'))


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=30), cuts=st.lists(st.integers(1, 5), min_size=1, max_size=40),
       ascii_only=st.booleans(), spaced=st.booleans())  # fmt: skip
def test_a_streamed_input_decodes_to_the_whole(text, cuts, ascii_only, spaced):
    """However the arguments are split into deltas and escaped, the decoded pieces join to the
    input, and no piece waits for the call's end when the head is the forced one."""
    value = json.dumps(text, ensure_ascii=ascii_only)
    arguments = ('{ "input" :  ' if spaced else '{"input": ') + value + "}"
    stream, pieces, at = InputStream(), [], 0
    for cut in cuts * (len(arguments) // len(cuts) + 1):
        if at >= len(arguments):
            break
        pieces.append(stream.feed(arguments[at : at + cut]))
        at += cut
    assert "".join(pieces) == text and stream.rest(arguments) == ""
    other = InputStream()
    assert other.feed('{"x": 1}') == "" and other.rest(arguments_of(text)) == text
