"""Free-form ("custom") tools: a tool whose input is one string, not JSON arguments, optionally
held to a regular expression (OpenAI's Responses ``{"type": "custom", "format": ...}``).

A model calls tools in its own JSON markup, so a custom tool is shown to it as a function with one
string parameter, ``input``, and its call's arguments are ``{"input": "<the text>"}``. A regex
on the text therefore applies to the *decoded* string, while the grammar reads the JSON-escaped
one (a newline is ``\\n`` in the arguments, a quote ``\\"``): `json_string_regex` rewrites a
pattern into the pattern of its matches' JSON encodings, which the call's grammar then forces
(tools/grammar.py). JSON schema's ``pattern`` would say the same, but xgrammar 0.2 expands
literal patterns without escaping them (a quote in the pattern ends the JSON string).

Patterns are read with Python's own regex parser: literals, classes (ranges, negation, ``\\d``
``\\w`` ``\\s``), ``.``, groups, alternation and repetition; a leading ``^`` and trailing ``$``
(the whole input must match anyway). Back-references, look-around, anchors elsewhere, inline
flags and counts over MAX_REPEAT raise ValueError, which the server answers with a 400.
"""

from __future__ import annotations

import json
import re
import warnings
from re import _constants as C  # noqa: N812 (the parser's opcode names)
from re import _parser as sre_parse

INPUT = "input"  # the one parameter a custom tool is shown with
# JSON string characters that appear escaped: the quote, the backslash, the controls
_SPECIAL = [chr(c) for c in range(0x20)] + ['"', "\\"]
_CATEGORIES = {
    C.CATEGORY_DIGIT: [(0x30, 0x39)],
    C.CATEGORY_WORD: [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)],
    C.CATEGORY_SPACE: [(0x09, 0x0D), (0x20, 0x20)],
}
_NOT_CATEGORIES = {
    C.CATEGORY_NOT_DIGIT: C.CATEGORY_DIGIT,
    C.CATEGORY_NOT_WORD: C.CATEGORY_WORD,
    C.CATEGORY_NOT_SPACE: C.CATEGORY_SPACE,
}
_MAX_CHAR = 0x10FFFF
# Flags that change what a pattern matches (case, dot, anchors, verbose syntax): refused rather
# than enforced as if absent
_FLAGS = re.IGNORECASE | re.DOTALL | re.MULTILINE | re.VERBOSE | re.ASCII | re.LOCALE
_METACHARACTERS = frozenset("\\.^$*+?()[]{}|")
# An explicit {m,n} above this is refused: the grammar's size grows with it
MAX_REPEAT = 1000


def input_parameters(description: str | None = None) -> dict[str, object]:
    """The JSON schema a custom tool is shown to the model with."""
    text: dict[str, object] = {"type": "string"}
    if description:
        text["description"] = description
    return {
        "type": "object",
        "properties": {INPUT: text},
        "required": [INPUT],
        "additionalProperties": False,
    }


def input_of(arguments: str) -> str:
    """A custom tool call's text from its JSON arguments: the decoded ``input``; of a call cut
    short (max_tokens), the part of it that was written; else the raw text (what the model
    wrote, rather than nothing)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        stream = InputStream()
        text = stream.feed(arguments)
        return text if stream.pos >= 0 else arguments
    if isinstance(value, dict) and isinstance(value.get(INPUT), str):
        return value[INPUT]
    return arguments


def arguments_of(text: str) -> str:
    """The JSON arguments of a custom tool call whose input is ``text`` (earlier turns)."""
    return json.dumps({INPUT: text}, ensure_ascii=False)


def json_string_regex(pattern: str) -> str:
    """The regex of the JSON string contents (between the quotes) whose decoded value matches
    ``pattern`` in full, the escapes written as json.dumps writes them."""
    try:
        with warnings.catch_warnings():  # "possible nested set" and the like: a client's pattern
            warnings.simplefilter("ignore")
            tree = sre_parse.parse(pattern)
    except (re.error, OverflowError) as exc:
        raise ValueError(f"not a valid regular expression: {exc}") from None
    except RecursionError:
        raise ValueError("the regular expression is nested too deeply") from None
    if tree.state.flags & _FLAGS:
        raise ValueError("regular expressions with inline flags are not supported here")
    items = list(tree)
    if items and items[0] == (C.AT, C.AT_BEGINNING):
        items = items[1:]
    if items and items[-1][0] is C.AT and items[-1][1] in (C.AT_END, C.AT_END_STRING):
        items = items[:-1]
    try:
        return _sequence(items)
    except RecursionError:
        raise ValueError("the regular expression is nested too deeply") from None


def _sequence(items: list) -> str:
    return "".join(_item(op, arg) for op, arg in items)


def _item(op, arg) -> str:  # noqa: ANN001 (the parser's untyped tuples)
    if op is C.LITERAL:
        return _escaped(chr(arg))
    if op is C.NOT_LITERAL:
        return _char_set([(0, arg - 1), (arg + 1, _MAX_CHAR)])
    if op is C.ANY:  # without DOTALL: anything but a newline
        return _char_set([(0, 9), (11, _MAX_CHAR)])
    if op is C.IN:
        return _char_set(_class_ranges(arg))
    if op is C.BRANCH:
        return "(" + "|".join(_sequence(list(branch)) for branch in arg[1]) + ")"
    if op is C.SUBPATTERN:
        if arg[1] or arg[2]:  # (?i:...) and the like
            raise ValueError("regular expressions with inline flags are not supported here")
        return "(" + _sequence(list(arg[-1])) + ")"
    if op in (C.MAX_REPEAT, C.MIN_REPEAT, C.POSSESSIVE_REPEAT):
        low, high, sub = arg
        if max(low, 0 if high is C.MAXREPEAT else high) > MAX_REPEAT:
            raise ValueError(f"repetition counts are at most {MAX_REPEAT} here")
        body = "(" + _sequence(list(sub)) + ")"
        if high is C.MAXREPEAT:
            return body + ("*" if low == 0 else "+" if low == 1 else f"{{{low},}}")
        return body + ("?" if (low, high) == (0, 1) else f"{{{low},{high}}}")
    raise ValueError(f"regular expressions with {str(op).lower()} are not supported here")


def _class_ranges(items: list) -> list[tuple[int, int]]:
    """A class's code-point ranges, negation resolved."""
    negate = bool(items) and items[0][0] is C.NEGATE
    ranges: list[tuple[int, int]] = []
    for op, arg in items[1:] if negate else items:
        if op is C.LITERAL:
            ranges.append((arg, arg))
        elif op is C.RANGE:
            ranges.append(arg)
        elif op is C.CATEGORY and arg in _CATEGORIES:
            ranges.extend(_CATEGORIES[arg])
        elif op is C.CATEGORY and arg in _NOT_CATEGORIES:
            ranges.extend(_complement(_CATEGORIES[_NOT_CATEGORIES[arg]]))
        else:
            raise ValueError(f"character classes with {str(op).lower()} are not supported here")
    return _complement(ranges) if negate else ranges


def _complement(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out, start = [], 0
    for low, high in sorted(ranges):
        if low > start:
            out.append((start, low - 1))
        start = max(start, high + 1)
    if start <= _MAX_CHAR:
        out.append((start, _MAX_CHAR))
    return out


def _char_set(ranges: list[tuple[int, int]]) -> str:
    """One character of the set, JSON-escaped: its plain characters as a class, each special
    one (quote, backslash, controls) as its escape."""
    special = {ord(c) for c in _SPECIAL}
    ranges = [r for low, high in ranges for r in _without_surrogates(low, high)]
    plain: list[str] = []
    escapes: list[str] = []
    for low, high in ranges:
        start = low
        for code in range(low, min(high, 0x7F) + 1):  # the specials are all ASCII
            if code in special:
                if start < code:
                    plain.append(_class_range(start, code - 1))
                escapes.append(_escaped(chr(code)))
                start = code + 1
        if start <= high:
            plain.append(_class_range(start, high))
    options = (["[" + "".join(plain) + "]"] if plain else []) + escapes
    if not options:
        raise ValueError("a character class matches no character")
    return options[0] if len(options) == 1 else "(" + "|".join(options) + ")"


def _without_surrogates(low: int, high: int) -> list[tuple[int, int]]:
    """(low, high) less U+D800-U+DFFF, which no UTF-8 text holds."""
    parts = [(low, min(high, 0xD7FF)), (max(low, 0xE000), high)]
    return [(a, b) for a, b in parts if a <= b]


def _class_range(low: int, high: int) -> str:
    return _class_char(low) if low == high else f"{_class_char(low)}-{_class_char(high)}"


def _class_char(code: int) -> str:
    char = chr(code)
    if char in "\\]^-[":
        return "\\" + char
    return char


def _escaped(char: str) -> str:
    """The JSON encoding of one character, as a regex that matches just it."""
    return regex_literal(json.dumps(char, ensure_ascii=False)[1:-1])


def regex_literal(text: str) -> str:
    """A regex matching ``text``: its metacharacters escaped, nothing else (re.escape also
    escapes spaces and the like, which xgrammar's regex reader warns about on every compile)."""
    return "".join("\\" + c if c in _METACHARACTERS else c for c in text)


_HEAD = re.compile(r'\s*\{\s*"' + INPUT + r'"\s*:\s*"')
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


class InputStream:
    """A custom call's input decoded as its JSON arguments stream in: ``feed`` returns the text
    that the new characters complete (an escape split across deltas waits for its end). The
    arguments the grammar forces start ``{"input": "``; anything else streams nothing, and the
    whole input comes at the call's end (``rest``)."""

    def __init__(self) -> None:
        self.buffer = ""
        self.pos = -1  # where the string's undecoded characters start; -1: the head not yet read
        self.text = ""  # decoded so far
        self.closed = False

    def feed(self, delta: str) -> str:
        self.buffer += delta
        if self.pos < 0:
            head = _HEAD.match(self.buffer)
            if head is None:
                return ""
            self.pos = head.end()
        out = []
        while not self.closed and self.pos < len(self.buffer):
            char = self.buffer[self.pos]
            if char == '"':
                self.closed = True
                break
            if char != "\\":
                out.append(char)
                self.pos += 1
                continue
            decoded, length = self._escape(self.pos)
            if decoded is None:  # the escape goes on in a later delta
                break
            out.append(decoded)
            self.pos += length
        new = "".join(out)
        self.text += new
        return new

    def rest(self, arguments: str) -> str:
        """What the whole input adds to the text already streamed (all of it when the head never
        matched)."""
        whole = input_of(arguments)
        return whole[len(self.text) :] if whole.startswith(self.text) else ""

    def _escape(self, at: int) -> tuple[str | None, int]:
        """The escape at ``at`` (a backslash): its character and length, or None if incomplete."""
        buffer = self.buffer
        if at + 1 >= len(buffer):
            return None, 0
        kind = buffer[at + 1]
        if kind != "u":
            return _ESCAPES.get(kind, kind), 2
        if at + 6 > len(buffer):
            return None, 0
        code = int(buffer[at + 2 : at + 6], 16)
        if 0xD800 <= code < 0xDC00:  # a surrogate pair: the low half's escape follows
            if at + 12 > len(buffer):
                return None, 0
            low = int(buffer[at + 8 : at + 12], 16)
            return chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)), 12
        return chr(code), 6
