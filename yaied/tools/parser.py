"""Streaming tool-call parser: text deltas in, content and tool-call events out.

The parser is fed the detokenizer's text deltas and returns events as soon as they are certain:

- text that cannot be markup goes out as `ContentDelta` at once;
- text that might be the start of a trigger (a prefix of `<tool_call>`) is held back until the
  next delta decides it, so markup never reaches content;
- a call is buffered until its JSON object closes; then, if it parses and names a function, it
  goes out as `ToolCallStart` (index, id, name), one `ToolCallArguments` fragment holding the
  arguments as JSON text (json.dumps of the parsed object), and `ToolCallEnd`.

Buffering whole calls costs the client argument streaming but means an event, once sent, is never
wrong: there is no half-sent call to retract when the model breaks the JSON. Where a grammar
forces every call's markup (`stream_arguments`: the chat path sets it whenever tools are active),
a call whose object opens with its name and then its arguments object goes out as it comes:
`ToolCallStart` once the name is read, the arguments' raw text in `ToolCallArguments` fragments
as they arrive, `ToolCallEnd` when the object closes. Its arguments are then the model's text
as written (valid JSON, not re-dumped). There only max_tokens can cut a call: one cut in its
arguments ends with those it had, one cut before them is dropped; both are noted in `errors`.

Decisions a caller must know:

- A malformed call (not JSON, not an object with a string "name" and object arguments, a name
  outside `tool_names`, or cut off by the end of the stream without such a grammar) is reported
  as content, markup included, exactly as the model wrote it, and noted in
  `ParsedMessage.errors`; nothing the model wrote is lost.
- Whitespace that only separates text from markup is dropped: before a call, after a call when
  nothing else follows, and at the start of content that follows a call. A message without calls
  comes out byte for byte.
- llama3_json: a message that starts with "{" is held until the object closes; if it is not a
  call (a JSON answer) it goes to content unchanged. Text after a run of calls is content.
- hermes: junk between a call's closing brace and `</tool_call>` is dropped (noted in errors);
  a missing `</tool_call>` before the next `<tool_call>` or the end is tolerated.
"""

from __future__ import annotations

import enum
import functools
import json
from collections.abc import Callable, Collection

from yaied.tools._scan import (
    ARGUMENTS_VALUE,
    CALL_HEAD,
    INVALID,
    MAX_HEAD,
    MORE,
    JsonObjectScanner,
    StreamedCall,
    decode_call,
    find_first,
    json_string,
    partial_suffix,
)
from yaied.tools.events import (
    ContentDelta,
    ParsedMessage,
    ToolCall,
    ToolCallArguments,
    ToolCallEnd,
    ToolCallStart,
    ToolEvent,
    new_call_id,
)
from yaied.tools.formats import ToolCallFormat, get_format


class _State(enum.Enum):
    # Each value names the method that handles the state.
    TEXT = "_step_text"  # prose; looking for triggers
    OPEN = "_step_open"  # after a trigger or a separator; expecting "{"
    OBJECT = "_step_object"  # inside a call's JSON object
    AFTER = "_step_after"  # after a call's object: closing tag, separator, next call or prose
    SKIP = "_step_skip"  # hermes: junk after a call's object, dropped up to </tool_call>
    MALFORMED = "_step_malformed"  # hermes: a broken call, passed to content up to </tool_call>
    PLAIN = "_step_plain"  # llama3: the rest of the message is content


class ToolCallParser:
    """One parser per generated message (per choice). Call `feed` with each text delta, `finish`
    once at the end of the stream, then `result` for the whole message."""

    def __init__(
        self,
        fmt: str | ToolCallFormat = "hermes",
        *,
        tool_names: Collection[str] | None = None,
        id_factory: Callable[[], str] = new_call_id,
        stream_arguments: bool = False,
    ) -> None:
        self._fmt = get_format(fmt)
        self._stream_arguments = stream_arguments
        self._streaming: StreamedCall | None = None
        self._streamable = True  # the call in progress may still stream (its head not ruled out)
        self._tool_names = None if tool_names is None else frozenset(tool_names)
        self._new_id = id_factory
        self._state = _State.TEXT
        self._buf = ""  # received, not yet decided
        self._raw = ""  # markup consumed for the call in progress: content again if it breaks
        self._pending_ws = ""  # trailing whitespace of prose: dropped if a call follows it
        self._at_start = True  # nothing but whitespace seen yet (llama3's bare JSON)
        self._bare = False  # the object in progress opened the message without markup
        self._scanner = JsonObjectScanner()
        self._content: list[str] = []
        self._calls: list[ToolCall] = []
        self._errors: list[str] = []
        self._events: list[ToolEvent] = []
        self._finished = False

    def feed(self, delta: str) -> list[ToolEvent]:
        """The events that `delta` makes certain (possibly none)."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._buf += delta
        self._run(final=False)
        return self._take_events()

    def finish(self) -> list[ToolEvent]:
        """End of stream: decide everything held back."""
        if not self._finished:
            self._finished = True
            self._run(final=True)
            if not self._calls and self._pending_ws:
                self._emit(self._pending_ws)  # a message without calls comes out unchanged
            self._pending_ws = ""
        return self._take_events()

    def result(self) -> ParsedMessage:
        """The whole message so far (complete after `finish`)."""
        content = "".join(self._content)
        return ParsedMessage(content or None, list(self._calls), list(self._errors))

    def _run(self, final: bool) -> None:
        # Each step consumes from the buffer or changes state; it returns False when it needs
        # more text than there is.
        while getattr(self, self._state.value)(final):
            pass

    def _step_text(self, final: bool) -> bool:
        fmt, buf = self._fmt, self._buf
        if self._at_start and fmt.bare_json_at_start:
            body = buf.lstrip()
            if not body:
                if final:
                    self._text(buf)
                    self._buf = ""
                return False
            if body[0] == "{":  # llama3: the message opens with a call (or a JSON answer)
                self._at_start, self._bare = False, True
                self._raw = self._pending_ws + buf[: len(buf) - len(body)]
                self._pending_ws = ""
                self._buf = body
                self._state = _State.OPEN
                return True
        i, trigger = find_first(buf, fmt.triggers)
        if i >= 0:
            self._text(buf[:i])
            self._at_start = False
            self._raw = self._pending_ws + trigger  # whitespace before a call is dropped...
            self._pending_ws = ""  # ...unless the call breaks and all goes back to content
            self._buf = buf[i + len(trigger) :]
            self._state = _State.OPEN
            return True
        keep = partial_suffix(buf, fmt.triggers)
        text = buf[: len(buf) - keep]
        if final and keep and self._stream_arguments and not self._content and not text.strip():
            # Under the tool grammar only a call opens where the message is calls or nothing
            # so far: max_tokens cut its marker, which is no content.
            self._errors.append("the stream ended inside a call's marker")
            buf = text
        if final:
            text, keep = buf, 0
        self._text(text)
        if text.strip():
            self._at_start = False
        self._buf = buf[len(buf) - keep :]
        return False

    def _step_open(self, final: bool) -> bool:
        body = self._buf.lstrip()
        if not body:
            self._raw += self._buf
            self._buf = ""
            if final and self._raw.strip() == (self._fmt.separator or ""):
                self._raw = ""  # llama3: a separator with no call after it is dropped
            elif final:
                self._malformed("the stream ended before the call's JSON object", 0, cut=True)
            return False
        self._raw += self._buf[: len(self._buf) - len(body)]
        self._buf = body
        if body[0] != "{":
            self._malformed("no JSON object after the call marker", 0)
            return True
        self._scanner = JsonObjectScanner()
        self._streamable = self._stream_arguments and not self._bare
        self._state = _State.OBJECT
        return True

    def _step_object(self, final: bool) -> bool:
        if self._streamable and self._streaming is None:
            self._start_streaming()
        if self._streaming is not None:
            return self._step_streaming(final)
        end = self._scanner.scan(self._buf)
        if end == MORE:
            if final:
                self._malformed(
                    "the stream ended inside the call's JSON object", len(self._buf), cut=True
                )
            return False
        if end == INVALID:
            self._malformed("the call is not valid JSON", self._scanner.failed_at)
            return True
        decoded = decode_call(self._buf[:end], self._fmt.accepted_argument_keys, self._tool_names)
        if isinstance(decoded, str):
            self._malformed(decoded, end)
            return True
        name, arguments = decoded[0], json.dumps(decoded[1], ensure_ascii=False)
        index = len(self._calls)
        self._calls.append(ToolCall(self._new_id(), name, arguments))
        self._events += [
            ToolCallStart(index, self._calls[-1].id, name),
            ToolCallArguments(index, arguments),
            ToolCallEnd(index),
        ]
        self._raw = ""
        self._bare = False
        self._buf = self._buf[end:]
        self._state = _State.AFTER
        return True

    def _start_streaming(self) -> None:
        """Send the call's start once its head is read, if the head is the streamable one."""
        head = CALL_HEAD.match(self._buf)
        if head is None:
            # not yet: wait until the arguments begin without such a head, or it outgrows one
            self._streamable = len(self._buf) < MAX_HEAD and not ARGUMENTS_VALUE.search(self._buf)
            return
        start = head.end()
        if start == len(self._buf):
            return  # the arguments' first character decides
        name = json_string(head.group(1))  # None: an escape JSON lacks (reported when buffered)
        known = self._tool_names is None or name in self._tool_names
        if self._buf[start] != "{" or not name or not known:
            self._streamable = False  # arguments as a string, or no such tool: buffered
            return
        index = len(self._calls)
        self._streaming = StreamedCall(index, self._new_id(), name, start)
        self._events.append(ToolCallStart(index, self._streaming.call_id, name))

    def _step_streaming(self, final: bool) -> bool:
        call = self._streaming
        assert call is not None
        arguments = self._buf[call.start :]
        if call.end < 0:
            end = call.scanner.scan(arguments)
            call.end = end if end >= 0 else -1
            if end == INVALID:
                return self._end_streaming("the call's arguments are not a JSON object", None)
        upto = call.end if call.end >= 0 else len(arguments)
        if upto > call.sent:
            self._events.append(ToolCallArguments(call.index, arguments[call.sent : upto]))
            call.sent = upto
        if call.end < 0:
            if final:
                return self._end_streaming("the stream ended inside the call's JSON object", None)
            return False
        end = self._scanner.scan(self._buf)  # the call object's own closing brace
        if end == INVALID:
            return self._end_streaming("the call is not valid JSON", None)
        if end == MORE:
            if final:
                return self._end_streaming("the stream ended inside the call's JSON object", None)
            return False
        return self._end_streaming(None, end)

    def _end_streaming(self, error: str | None, end: int | None) -> bool:
        """The streamed call ends at `end` (None: broken), with the arguments it sent."""
        call = self._streaming
        assert call is not None
        arguments = self._buf[call.start : call.start + call.sent]
        self._calls.append(ToolCall(call.call_id, call.name, arguments))
        self._events.append(ToolCallEnd(call.index))
        if error is not None:
            self._errors.append(error)
        self._buf = self._buf[end if end is not None else call.start + call.sent :]
        self._streaming, self._raw, self._bare = None, "", False
        self._state = _State.AFTER
        return True

    def _step_after(self, final: bool) -> bool:
        fmt = self._fmt
        body = self._buf.lstrip()
        self._buf = body  # whitespace between markup is dropped
        if not body:
            return False
        if fmt.call_end is not None:  # hermes: expect </tool_call>
            if body.startswith(fmt.call_end):
                self._buf = body[len(fmt.call_end) :]
                self._state = _State.TEXT
                return True
            if body.startswith(fmt.triggers):
                self._errors.append(f"a call without {fmt.call_end}")
                self._state = _State.TEXT
                return True
            if not final and any(m.startswith(body) for m in (fmt.call_end, *fmt.triggers)):
                return False
            self._errors.append(f"text between a call and {fmt.call_end} dropped")
            self._state = _State.SKIP
            return True
        # llama3: a separator or another object continues the run; anything else is prose.
        if fmt.separator and body.startswith(fmt.separator):
            self._raw = fmt.separator
            self._buf = body[len(fmt.separator) :]
            self._state = _State.OPEN
            return True
        if body[0] == "{":
            self._state = _State.OPEN
            return True
        if not final and any(t.startswith(body) for t in fmt.triggers):
            return False
        self._state = _State.TEXT
        return True

    def _until_call_end(self, final: bool, keep_text: bool) -> bool:
        """hermes: consume up to and including </tool_call>, as content or dropped."""
        end = self._fmt.call_end or ""
        i = self._buf.find(end)
        cut = i + len(end) if i >= 0 else len(self._buf)
        if i < 0 and not final:
            cut -= partial_suffix(self._buf, (end,))
        if keep_text:
            self._text(self._buf[:cut])
        self._buf = self._buf[cut:]
        if i >= 0:
            self._state = _State.TEXT
        return i >= 0

    _step_skip = functools.partialmethod(_until_call_end, keep_text=False)  # _State.SKIP
    _step_malformed = functools.partialmethod(_until_call_end, keep_text=True)  # MALFORMED

    def _step_plain(self, final: bool) -> bool:
        self._text(self._buf)
        self._buf = ""
        return False

    def _malformed(self, reason: str, at: int, cut: bool = False) -> None:
        """The call in progress is broken: its markup and text up to `at` become content, and
        the rest is read as content up to the closing tag (hermes) or the end (llama3). With
        `cut` (the stream ended inside a call not yet streamed) under a grammar that forces
        every call's markup (`stream_arguments`), only max_tokens cut it: dropped, noted."""
        if cut and self._stream_arguments and not self._bare:
            self._errors.append(reason)
            self._raw = self._buf = ""
            self._state = _State.TEXT
            return
        if not self._bare:  # a JSON answer that is not a call is content, not an error
            self._errors.append(reason)
        self._text(self._raw + self._buf[:at])
        self._raw = ""
        self._buf = self._buf[at:]
        self._state = _State.MALFORMED if self._fmt.call_end else _State.PLAIN

    def _text(self, text: str) -> None:
        """Prose. Its trailing whitespace waits: a call may follow, and then it is dropped."""
        body = text.rstrip()
        if not body:
            self._pending_ws += text
            return
        out = self._pending_ws + body
        self._pending_ws = text[len(body) :]
        if self._calls and not self._content:
            out = out.lstrip()  # content that follows a call starts at its first word
        self._emit(out)

    def _emit(self, text: str) -> None:
        self._content.append(text)
        if self._events and isinstance(self._events[-1], ContentDelta):
            self._events[-1] = ContentDelta(self._events[-1].text + text)
        else:
            self._events.append(ContentDelta(text))

    def _take_events(self) -> list[ToolEvent]:
        events, self._events = self._events, []
        return events


def parse_tool_calls(
    text: str,
    fmt: str | ToolCallFormat = "hermes",
    *,
    tool_names: Collection[str] | None = None,
    id_factory: Callable[[], str] = new_call_id,
) -> ParsedMessage:
    """The non-streaming path: one whole message. Same result as feeding it in any pieces."""
    parser = ToolCallParser(fmt, tool_names=tool_names, id_factory=id_factory)
    parser.feed(text)
    parser.finish()
    return parser.result()
