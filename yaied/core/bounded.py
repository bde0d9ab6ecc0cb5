"""What another process sends over HTTP, read within a bound: the lines of an event stream, a
whole body.

A peer that sends more than the bound (a line that never ends, a body of gigabytes: a broken or
hostile server) raises TooLong, having held no more than the bound and one chunk, and having
spent time in proportion to what it held. Both take the body's chunks as bytes, so the router's
asynchronous reads and the CLI's synchronous ones share them.
"""

from __future__ import annotations

_EOL = (b"\n", b"\r")


class TooLong(Exception):
    """A line or a body past its bound."""


class LineSplitter:
    """A body's lines, fed chunk by chunk: each ended by LF, CRLF or CR (a CRLF split across two
    chunks gives an extra empty line, which SSE ignores), decoded as UTF-8 (bytes that are not
    become U+FFFD), of at most ``limit`` bytes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._pending: list[bytes] = []  # the unended line's chunks, none with a line end
        self._size = 0

    def feed(self, chunk: bytes) -> list[str]:
        if b"\n" not in chunk and b"\r" not in chunk:  # the common case of a long line: no copy
            self._size += len(chunk)
            self._pending.append(chunk)
            if self._size > self.limit:
                raise TooLong(f"a line of over {self.limit} bytes with no end")
            return []
        lines = b"".join((*self._pending, chunk)).splitlines(keepends=True)
        rest = lines.pop() if not lines[-1].endswith(_EOL) else b""
        self._pending, self._size = ([rest] if rest else []), len(rest)
        if self._size > self.limit:
            raise TooLong(f"a line of over {self.limit} bytes with no end")
        for line in lines:
            if len(line) > self.limit + 2:  # a long one that ended in this very chunk
                raise TooLong(f"a line of {len(line)} bytes")
        return [line.rstrip(b"\r\n").decode(errors="replace") for line in lines]

    def end(self) -> list[str]:
        """The last line, when the body ended without a line end."""
        rest = b"".join(self._pending)
        self._pending, self._size = [], 0
        return [rest.decode(errors="replace")] if rest else []


class BodyBuffer:
    """A whole body of at most ``limit`` bytes, fed chunk by chunk."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._chunks: list[bytes] = []
        self._size = 0

    def feed(self, chunk: bytes) -> None:
        self._size += len(chunk)
        if self._size > self.limit:
            raise TooLong(f"a body of over {self.limit} bytes")
        self._chunks.append(chunk)

    def value(self) -> bytes:
        return b"".join(self._chunks)
