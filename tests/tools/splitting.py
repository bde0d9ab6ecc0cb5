"""Ways to cut one text into deltas, for parsers that must not care where the cuts fall."""

from __future__ import annotations

import random
from collections.abc import Iterator


def splits(text: str, *, seed: int = 0, n_random: int = 20) -> Iterator[list[str]]:
    """The whole text; every cut into two pieces; one character per piece; and `n_random`
    random cuts into pieces of 1 to 8 characters (with empty deltas mixed in, which the
    detokenizer can produce)."""
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    yield list(text)
    rng = random.Random(f"{seed}:{text}")
    for _ in range(n_random):
        pieces, i = [], 0
        while i < len(text):
            if rng.random() < 0.1:
                pieces.append("")
            n = rng.randint(1, 8)
            pieces.append(text[i : i + n])
            i += n
        yield pieces
