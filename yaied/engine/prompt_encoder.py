"""Chat prompts tokenized piece by piece, each piece once: a conversation's history is not
tokenized again on every turn.

An agent or chat client sends the whole conversation each turn (or names the previous response,
which the server expands into it), so a turn's prompt is the last turn's plus a little. The
rendered text is mostly the same characters every time, and tokenizing it cost about 2 us a token
here (1.2 ms for a 600-token history, on the request's critical path, more than the prefix cache
leaves of the prefill).

Hugging Face tokenizers find the added (special) tokens in the raw text first and run the
normaliser, pre-tokeniser and model on each stretch between them on its own. So the text is cut
before each special token, each piece (a special token and the text up to the next) is
tokenized on its own and cached, and the pieces' ids joined are the whole text's ids. Only
special tokens that match exactly where they stand are cut at: one that strips the whitespace
before it (``lstrip``) reaches back into the piece before, and is left to the tokenizer inside
a piece. A tokenizer for which the joined pieces differ from the whole on a few probe texts (a
pre-tokeniser that looks across the cuts, a slow tokenizer) is not cut at all.
"""

from __future__ import annotations

import re
import threading
from array import array
from collections import OrderedDict
from typing import Any

# The cache's bound, in characters of cached pieces (ids are stored 4 bytes each, about a
# token per 4 characters: a few MB at the bound).
MAX_CACHED_CHARS = 4 << 20
# A piece longer than this is tokenized but not cached (a document pasted once).
MAX_PIECE_CHARS = 256 << 10

_PROBES = (
    "{0}system\nYou are terse.{1}\n{0}user\n  Hello ,  world!\n\n{1}\n{0}assistant\n",
    "plain text before{0} directly after{1}{1}\n\t tabs and  spaces {0}\n\n",
    "{0}user\nnaïve café — ✓ 数字 123,456.78 {1} trailing   ",
)


class PromptEncoder:
    """``encode(text)``: what ``tokenizer.encode(text, add_special_tokens=False)`` returns,
    from cached pieces where the tokenizer allows it (``cuts``), whole otherwise. Safe to call
    from several threads."""

    def __init__(self, tokenizer: Any, max_cached_chars: int = MAX_CACHED_CHARS) -> None:
        self.tokenizer = tokenizer
        self.max_cached_chars = max_cached_chars
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._pieces: OrderedDict[str, array] = OrderedDict()
        self._cached_chars = 0
        self._lock = threading.Lock()
        self._cut_before: re.Pattern[str] | None = None
        specials = _exact_special_tokens(tokenizer) if self._backend is not None else []
        if specials:
            alternatives = "|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True))
            self._cut_before = re.compile(alternatives)
            if not self._agrees_on_probes(specials):
                self._cut_before = None
        self.clear()

    @property
    def cuts(self) -> bool:
        """Whether prompts are tokenized in cached pieces (else whole, every time)."""
        return self._cut_before is not None

    @property
    def cached_chars(self) -> int:
        return self._cached_chars

    def encode(self, text: str) -> list[int]:
        if self._cut_before is None:
            return self._whole(text)
        ids: list[int] = []
        start = 0
        for match in self._cut_before.finditer(text):
            if match.start() > start:
                ids.extend(self._piece(text[start : match.start()]))
                start = match.start()
        if start < len(text):
            ids.extend(self._piece(text[start:]))
        return ids

    def clear(self) -> None:
        with self._lock:
            self._pieces.clear()
            self._cached_chars = 0

    def _whole(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _piece(self, piece: str) -> array:
        with self._lock:
            ids = self._pieces.get(piece)
            if ids is not None:
                self._pieces.move_to_end(piece)
                return ids
        ids = array("I", self._backend.encode(piece, add_special_tokens=False).ids)
        if len(piece) <= MAX_PIECE_CHARS:
            with self._lock:
                if piece not in self._pieces:
                    self._pieces[piece] = ids
                    self._cached_chars += len(piece)
                while self._cached_chars > self.max_cached_chars:
                    dropped, _ = self._pieces.popitem(last=False)
                    self._cached_chars -= len(dropped)
        return ids

    def _agrees_on_probes(self, specials: list[str]) -> bool:
        """The pieces' ids against the whole text's on probe texts around the first two special
        tokens (whitespace on both sides, no text between, text before the first)."""
        first, second = (specials * 2)[:2]
        try:
            for probe in _PROBES:
                text = probe.format(first, second)
                if self.encode(text) != self._whole(text):
                    return False
        except Exception:  # noqa: BLE001 - a tokenizer that cannot be probed is not cut
            return False
        return True


def _exact_special_tokens(tokenizer: Any) -> list[str]:
    """The special tokens' texts that the tokenizer matches as they stand: not normalised first,
    not only as whole words, not taking the whitespace before them."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    found = []
    for token in decoder.values():
        content = getattr(token, "content", "")
        if not content or not getattr(token, "special", False):
            continue
        if getattr(token, "lstrip", False) or getattr(token, "single_word", False):
            continue
        if getattr(token, "normalized", False):
            continue
        found.append(content)
    return found
