"""Tokens as the logprobs of a response name them: each token's own bytes, its name, and text
offsets that agree with the response's text.

A token's bytes are its vocabulary piece with the tokenizer's mapping undone, not
``decode([token])``: decoding one token alone loses what the token is (half a UTF-8 character
decodes to U+FFFD, and SentencePiece's decoder drops the leading space of a sequence's first
token). For byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM) each character of the piece maps back to
one byte; for SentencePiece, ``▁`` is a space and ``<0xNN>`` pieces are single bytes. A tokenizer
whose decoder is of another kind (WordPiece, ...) falls back to decoding the token alone.

A token's name (``tokens`` and the ``top_logprobs`` keys of completions, ``token`` of chat) is its
bytes as text when they are valid UTF-8, else OpenAI's escape for a piece of a character:
``bytes:`` then ``\\xNN`` for each byte (``b"\\xf0\\x9f"`` is ``"bytes:\\\\xf0\\\\x9f"``). Chat's
``bytes`` field carries the real bytes either way, so joining them rebuilds the text.

``text_offset[i]`` is the number of characters of the response's text that come before token i:
the characters completed by the tokens before it. A token that continues an unfinished character
has the offset of that character. The offsets come from decoding the tokens one at a time exactly
as the engine's detokenizer made the text, so they follow the tokenizer's spacing rules.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Sequence
from typing import Any

from yaied.core.detokenizer import IncrementalDetokenizer

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
Piece = str | bytes  # a piece on its way through the decoder steps: bytes once it is raw bytes
Step = Callable[[Piece], Piece]


@functools.cache
def _byte_level_chars() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: the printable character standing for each byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\N{INVERTED EXCLAMATION MARK}"), ord("\N{NOT SIGN}") + 1),
        *range(ord("\N{REGISTERED SIGN}"), ord("\N{LATIN SMALL LETTER Y WITH DIAERESIS}") + 1),
    ]
    chars = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _from_byte_level(piece: Piece) -> Piece:
    if isinstance(piece, bytes):
        return piece
    table = _byte_level_chars()
    out = bytearray()
    for char in piece:
        byte = table.get(char)
        out += char.encode() if byte is None else bytes((byte,))
    return bytes(out)


def _byte_fallback(piece: Piece) -> Piece:
    if isinstance(piece, str):
        found = _BYTE_PIECE.fullmatch(piece)
        if found:
            return bytes((int(found.group(1), 16),))
    return piece


def _replace(old: str, new: str) -> Step:
    return lambda piece: piece.replace(old, new) if isinstance(piece, str) else piece


def _steps(spec: dict[str, Any] | None) -> list[Step] | None:
    """The per-token part of a `tokenizers` decoder; None when it has a kind we cannot undo."""
    if spec is None:
        return []
    kind = spec.get("type")
    if kind == "Sequence":
        steps: list[Step] = []
        for inner in spec.get("decoders") or []:
            more = _steps(inner)
            if more is None:
                return None
            steps += more
        return steps
    if kind == "ByteLevel":
        return [_from_byte_level]
    if kind == "ByteFallback":
        return [_byte_fallback]
    if kind == "Metaspace":
        return [_replace(spec.get("replacement") or "\N{LOWER ONE EIGHTH BLOCK}", " ")]
    if kind == "Replace":
        pattern = spec.get("pattern") or {}
        if "String" not in pattern:
            return None  # a regex replacement: rare, and not worth a second regex dialect
        return [_replace(pattern["String"], spec.get("content", ""))]
    if kind in ("Fuse", "Strip"):  # joining pieces, and stripping at the sequence's start
        return []
    return None


def _decoder_steps(tokenizer: Any) -> list[Step] | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    decoder = backend.decoder
    if decoder is None:
        return []
    try:
        spec = json.loads(decoder.__getstate__())
    except (AttributeError, TypeError, ValueError):
        return None
    return _steps(spec)


def token_name(data: bytes) -> str:
    """The token's bytes as text, or ``bytes:\\xNN...`` when they are not valid UTF-8."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


class TokenText:
    """Token names, bytes and text offsets for one tokenizer. Without a tokenizer, tokens are
    named ``token_id:N`` (vLLM's convention) and offsets count those names."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._steps = None if tokenizer is None else _decoder_steps(tokenizer)
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self._added = {i: token.content for i, token in added.items()}
        self._bytes: dict[int, bytes] = {}

    @staticmethod
    def of(tokenizer: Any) -> TokenText:
        """The shared TokenText of ``tokenizer``, built on first use."""
        return _of(tokenizer)

    def token_bytes(self, token_id: int) -> bytes:
        data = self._bytes.get(token_id)
        if data is None:
            data = self._bytes[token_id] = self._compute_bytes(token_id)
        return data

    def _compute_bytes(self, token_id: int) -> bytes:
        if self.tokenizer is None:
            return f"token_id:{token_id}".encode()
        if token_id in self._added:  # added and special tokens decode to their content
            return self._added[token_id].encode()
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if self._steps is None or not isinstance(piece, str):
            return self.tokenizer.decode([token_id]).encode()
        out: Piece = piece
        for step in self._steps:
            out = step(out)
        return out if isinstance(out, bytes) else out.encode()

    def name(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return token_name(self.token_bytes(token_id))

    def prompt_offsets(self, prompt_ids: Sequence[int], prompt_text: str) -> list[int]:
        """Each prompt token's offset in ``prompt_text`` (echo): the prompt given as text, or
        the ids decoded with their special tokens (``decode_prompt``). Special tokens the
        tokenizer added around a text prompt (a BOS) stand for no text."""
        if self.tokenizer is None:
            return self._name_offsets(prompt_ids, 0)
        ids = list(prompt_ids)
        lead = trail = 0
        if self.decode_prompt(ids) != prompt_text:
            plain = self.tokenizer.encode(prompt_text, add_special_tokens=False)
            for start in range(min(len(ids) - len(plain), 8) + 1):  # a BOS or two in front
                if plain and ids[start : start + len(plain)] == plain:
                    lead, trail = start, len(ids) - start - len(plain)
                    break
        offsets = [0] * lead
        decoder = _Offsets(self.tokenizer, [], skip_special_tokens=False, base=0)
        offsets += [decoder.next(token_id) for token_id in ids[lead : len(ids) - trail]]
        return offsets + [len(prompt_text)] * trail

    def output_offsets(
        self, prompt_ids: Sequence[int], skip_special_tokens: bool, base: int
    ) -> Callable[[int], int]:
        """A function from each output token, in order, to its offset; ``base`` is the length
        of the text before the output (the echoed prompt's)."""
        if self.tokenizer is None:
            counter = [base]

            def by_name(token_id: int) -> int:
                offset = counter[0]
                counter[0] += len(self.name(token_id))
                return offset

            return by_name
        return _Offsets(self.tokenizer, prompt_ids, skip_special_tokens, base).next

    def decode_prompt(self, prompt_ids: Sequence[int]) -> str:
        """A token-id prompt as echo shows it: special tokens kept, no clean-up of spaces."""
        if self.tokenizer is None:
            return ""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None:
            return backend.decode(list(prompt_ids), skip_special_tokens=False)
        return self.tokenizer.decode(
            list(prompt_ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
        )

    def _name_offsets(self, ids: Sequence[int], base: int) -> list[int]:
        offsets = []
        for token_id in ids:
            offsets.append(base)
            base += len(self.name(token_id))
        return offsets


class _Offsets:
    """Characters decided before each token, as the engine's detokenizer decides them."""

    __slots__ = ("_detokenizer", "_count")

    def __init__(
        self, tokenizer: Any, prompt_ids: Sequence[int], skip_special_tokens: bool, base: int
    ) -> None:
        self._detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens
        )
        self._count = base

    def next(self, token_id: int) -> int:
        offset = self._count
        self._count += len(self._detokenizer.push(token_id))
        return offset


# One TokenText a tokenizer (its byte table fills as tokens are named).
_of = functools.lru_cache(maxsize=4)(TokenText)
