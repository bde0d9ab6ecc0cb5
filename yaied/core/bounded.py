"""What another process sends over HTTP, read within a bound: the lines of an event stream, a
whole body.

A peer that sends more than the bound (a line that never ends, a body of gigabytes: a broken or
hostile server) raises TooLong, having held no more than the bound and one chunk, and having
spent time in proportion to what it held. Both take the body's chunks as bytes, so the router's
asynchronous reads and the CLI's synchronous ones share them.

A chunk is what `Decoder` gives: the body as sent (httpx's ``iter_raw``), decompressed in pieces
of at most PIECE_BYTES. httpx's own decoding (``iter_bytes``) expands a whole network read at
once, so a few kilobytes of gzip became megabytes before any bound saw them. Readers ask for
``Accept-Encoding: identity`` (ACCEPT_IDENTITY); Decoder is for a peer that compresses anyway.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

_EOL = (b"\n", b"\r")
# The most a compressed chunk gives at a time: what a bound may hold past itself.
PIECE_BYTES = 64 << 10
# The header that asks a peer not to compress (httpx asks for gzip and deflate by default).
ACCEPT_IDENTITY = {"Accept-Encoding": "identity"}
_WBITS = {"gzip": zlib.MAX_WBITS | 16, "x-gzip": zlib.MAX_WBITS | 16, "deflate": zlib.MAX_WBITS}


class TooLong(Exception):
    """A line or a body past its bound."""


class BadEncoding(Exception):
    """A body in a Content-Encoding this reader does not read, or not valid in its own."""


class Decoder:
    """A body's bytes as sent, decoded as its Content-Encoding says (none or identity: as they
    are; gzip, x-gzip, deflate, zlib-wrapped or raw), in pieces of at most PIECE_BYTES however
    far a chunk expands. Another encoding (br, zstd, several) raises BadEncoding at once."""

    def __init__(self, content_encoding: str | None) -> None:
        names = [n.strip().lower() for n in (content_encoding or "").split(",")]
        names = [n for n in names if n not in ("", "identity")]
        if len(names) > 1 or (names and names[0] not in _WBITS):
            raise BadEncoding(f"a body in Content-Encoding {content_encoding!r}, not read here")
        self.encoding = names[0] if names else None
        self._inflater = None if self.encoding is None else zlib.decompressobj(_WBITS[names[0]])
        self._started = False  # deflate: the first bytes say which of its two forms it is
        self._head = b""  # deflate: what came before those two bytes had

    def feed(self, chunk: bytes) -> Iterator[bytes]:
        if self._inflater is None:
            if chunk:
                yield chunk
            return
        if self.encoding == "deflate" and not self._started:
            self._head += chunk  # its first two bytes tell its form: wait for both
            if len(self._head) < 2:
                return
            chunk, self._head, self._started = self._head, b"", True
            self._inflater = _deflate_inflater(chunk)
        try:
            piece = self._inflater.decompress(chunk, PIECE_BYTES)
            while piece:
                yield piece
                piece = self._inflater.decompress(self._inflater.unconsumed_tail, PIECE_BYTES)
        except zlib.error as exc:
            raise BadEncoding(f"a body that is not valid {self.encoding}: {exc}") from None


def _deflate_inflater(first: bytes) -> zlib._Decompress:
    """The "deflate" encoding is zlib-wrapped by the standard and raw from some servers: the first
    bytes tell (a zlib header is a multiple of 31 as a big-endian 16-bit number, method 8)."""
    wrapped = first[0] & 0x0F == 8 and int.from_bytes(first[:2]) % 31 == 0
    return zlib.decompressobj(zlib.MAX_WBITS if wrapped else -zlib.MAX_WBITS)


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
