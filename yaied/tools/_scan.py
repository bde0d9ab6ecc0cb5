"""Small text scanners shared by the tool-call and reasoning parsers.

Both parsers receive text in arbitrary pieces (whatever the detokenizer produced), so each needs to
know how much of the tail might still turn into markup, and the tool parser needs to know where a
JSON object ends without waiting for a closing tag that may itself sit inside a JSON string.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

# Characters that may appear in JSON outside strings. Anything else there (such as the "<" of a
# closing tag) proves the object malformed at once, instead of at the end of the stream.
_JSON_OUTSIDE_STRINGS = frozenset(" \t\r\n{}[],:0123456789+-.eEtrufalsn")

MORE = -1  # JsonObjectScanner.scan: the object has not closed yet
INVALID = -2  # JsonObjectScanner.scan: `failed_at` holds the offending index


def partial_suffix(text: str, markers: Iterable[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `markers`: the part
    that must be held back, because the next piece may complete a marker."""
    best = 0
    for marker in markers:
        for k in range(min(len(text), len(marker) - 1), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best


def find_first(text: str, markers: Iterable[str]) -> tuple[int, str]:
    """(index, marker) of the earliest marker in `text`, or (-1, "")."""
    found, which = -1, ""
    for marker in markers:
        i = text.find(marker)
        if i >= 0 and (found < 0 or i < found):
            found, which = i, marker
    return found, which


class JsonObjectScanner:
    """Finds the end of a JSON object that starts at index 0 of a growing buffer.

    It tracks only strings, escapes and bracket depth, so a "}" or "</tool_call>" inside a string
    value does not end the call; the real parse (json.loads) happens once the object has closed.
    Scanning resumes where the previous call stopped, so feeding a long call piece by piece costs
    linear time overall."""

    __slots__ = ("_pos", "_depth", "_in_string", "_escape", "failed_at")

    def __init__(self) -> None:
        self._pos = 0
        self._depth = 0
        self._in_string = False
        self._escape = False
        self.failed_at = -1

    def scan(self, buf: str) -> int:
        """The index just past the closing brace, MORE, or INVALID. `buf` must only grow between
        calls (the same prefix, more text)."""
        pos, depth, in_string, escape = self._pos, self._depth, self._in_string, self._escape
        n = len(buf)
        result = MORE
        while pos < n:
            ch = buf[pos]
            pos += 1
            if in_string:
                if escape:
                    escape = False
                elif ch == "\\":
                    escape = True
                elif ch == '"':
                    in_string = False
            elif ch == '"':
                in_string = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth <= 0:
                    result = pos
                    break
            elif ch not in _JSON_OUTSIDE_STRINGS:
                self.failed_at = pos - 1
                result = INVALID
                break
        self._pos, self._depth, self._in_string, self._escape = pos, depth, in_string, escape
        return result


# A call object's head when it names its function first: `{"name": "<name>", "arguments": `
CALL_HEAD = re.compile(
    r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*'
)


ARGUMENTS_VALUE = re.compile(r'"(?:arguments|parameters)"\s*:\s*\S')
# Longer than any such head (a 64-character name, the keys, a little whitespace)
MAX_HEAD = 512


@dataclass(slots=True)
class StreamedCall:
    """The tool-call parser's call whose arguments are going out as they arrive."""

    index: int
    call_id: str
    name: str
    start: int  # where the arguments object starts in the parser's buffer
    sent: int = 0  # of its characters, sent
    end: int = -1  # its length once it has closed
    scanner: JsonObjectScanner = field(default_factory=JsonObjectScanner)


def json_string(literal: str) -> str | None:
    """The value of a JSON string literal (quotes included), or None if it is not one."""
    try:
        value = json.loads(literal)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def decode_call(
    text: str, argument_keys: tuple[str, ...], tool_names: Collection[str] | None = None
) -> tuple[str, dict[str, Any]] | str:
    """(name, arguments) of a closed call object, or why it is not a call (a name outside
    ``tool_names``, where given, included).

    Lenient where models are sloppy and the result is still unambiguous: raw control characters
    in strings, arguments written as a JSON string, a missing arguments key for a function
    without parameters."""
    try:
        obj = json.loads(text, strict=False, parse_constant=_reject_constant)
    except ValueError:
        return "the call is not valid JSON"
    name = obj.get("name") if isinstance(obj, dict) else None
    if not isinstance(name, str) or not name:
        return "the call has no function name"
    if tool_names is not None and name not in tool_names:
        return f"the call names an unknown function {name!r}"
    for key in argument_keys:
        if key not in obj:
            continue
        value = obj[key]
        if isinstance(value, str):
            try:
                value = json.loads(value, strict=False, parse_constant=_reject_constant)
            except ValueError:
                return "the call's arguments are not a JSON object"
        if not isinstance(value, dict):
            return "the call's arguments are not a JSON object"
        return name, value
    return name, {}


def _reject_constant(name: str) -> Any:
    # NaN and Infinity parse in Python but are not JSON: re-dumped, they would break clients.
    raise ValueError(f"{name} is not JSON")
