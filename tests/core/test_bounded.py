"""Reading a peer's lines and bodies within a bound, compressed or not (core/bounded.py)."""

from __future__ import annotations

import zlib

import pytest

from yaied.core.bounded import (
    PIECE_BYTES,
    BadEncoding,
    BodyBuffer,
    Decoder,
    LineSplitter,
    TooLong,
)


def split(chunks: list[bytes], limit: int = 64) -> list[str]:
    lines = LineSplitter(limit)
    out = [line for chunk in chunks for line in lines.feed(chunk)]
    return out + lines.end()


def test_lines_end_any_way_across_chunks():
    assert split([b"a\r\nb", b"c\rd\n", b"e"]) == ["a", "bc", "d", "e"]
    assert split([b"a\r", b"\nb\n"]) == ["a", "", "b"]  # a split CRLF: an empty line, as SSE skips
    assert split([b"\xffx\n"]) == ["\ufffdx"]


@pytest.mark.parametrize(
    "chunks",
    [
        [b"x" * 65],  # no end, in one chunk
        [b"x" * 40, b"x" * 40],  # no end, over two
        [b"x" * 40, b"x" * 40 + b"\n"],  # an end, but only after the bound
        [b"ok\n" + b"x" * 70 + b"\nmore"],  # a long one inside a chunk
    ],
)
def test_a_line_past_the_bound_raises(chunks):
    with pytest.raises(TooLong):
        split(chunks)


def test_a_line_at_the_bound_passes():
    assert split([b"x" * 32, b"x" * 32, b"\r\n"]) == ["x" * 64]


def test_a_body_past_the_bound_raises_having_held_no_more():
    body = BodyBuffer(10)
    body.feed(b"12345")
    body.feed(b"67890")
    assert body.value() == b"1234567890"
    with pytest.raises(TooLong, match="over 10 bytes"):
        body.feed(b"x")
    assert body.value() == b"1234567890"


def decode(encoding: str | None, body: bytes, split: int = 1000) -> list[bytes]:
    decoder = Decoder(encoding)
    return [p for i in range(0, len(body), split) for p in decoder.feed(body[i : i + split])]


@pytest.mark.parametrize(
    ("encoding", "wbits"),
    [("gzip", zlib.MAX_WBITS | 16), ("x-gzip", zlib.MAX_WBITS | 16), ("deflate", zlib.MAX_WBITS),
     ("Deflate", -zlib.MAX_WBITS), ("identity, gzip", zlib.MAX_WBITS | 16)],
)  # fmt: skip
def test_a_compressed_body_comes_out_whole_in_bounded_pieces(encoding, wbits):
    body = bytes(range(256)) * 4096 + b"x" * (1 << 20)  # 2 MiB, the second half 1000:1
    sent = zlib.compressobj(wbits=wbits)
    pieces = decode(encoding, sent.compress(body) + sent.flush())
    assert b"".join(pieces) == body and max(map(len, pieces)) <= PIECE_BYTES


def test_an_uncompressed_body_passes_as_it_is_and_others_are_refused():
    assert decode(None, b"abc", 2) == [b"ab", b"c"] == decode("identity", b"abc", 2)
    for encoding in ("br", "zstd", "gzip, gzip"):
        with pytest.raises(BadEncoding, match="Content-Encoding"):
            Decoder(encoding)
    with pytest.raises(BadEncoding, match="not valid gzip"):
        decode("gzip", b"not gzip at all")


@pytest.mark.parametrize("wbits", [zlib.MAX_WBITS, -zlib.MAX_WBITS])
def test_a_deflate_body_sent_a_byte_at_a_time_is_read_in_its_own_form(wbits):
    body = b"hello, " * 1000
    sent = zlib.compressobj(wbits=wbits)
    assert b"".join(decode("deflate", sent.compress(body) + sent.flush(), 1)) == body
