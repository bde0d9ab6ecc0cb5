"""Engines' names: what operators and the config call them, an ``[[engines]]`` entry's ``name``,
else one made from what the engine is (``local-cpu``, ``remote-10.0.0.2:8000``, ``-2`` on for
a second alike). The pool (pool.py) and the start's checks (capacity.py) name engines alike.
"""

from __future__ import annotations

from collections.abc import Iterable
from urllib.parse import urlsplit

from yaied.router.config import EngineEntry


def base_name(entry: EngineEntry) -> str:
    """An engine's name when its entry gives none: what it is and where."""
    if entry.name:
        return entry.name
    if entry.kind == "remote":
        return "remote-" + (urlsplit(entry.url).netloc or entry.url)
    if entry.kind == "ray":
        return f"ray-{entry.node}" if entry.node else "ray"
    return f"local-{entry.device}"


def entry_names(entries: Iterable[EngineEntry]) -> list[str]:
    """Each entry's name, in order; unnamed alike entries count up (``local-cpu``,
    ``local-cpu-2``), so the same config file always names its engines the same. Two entries
    given the same name are a ValueError."""
    entries = list(entries)
    given = [e.name for e in entries if e.name]
    if len(set(given)) != len(given):
        raise ValueError("two [[engines]] entries share a name")
    names: list[str] = []
    for entry in entries:
        name = base_name(entry)
        if not entry.name:
            name = first_free(name, set(names) | set(given))
        names.append(name)
    return names


def first_free(base: str, taken: set[str]) -> str:
    name, n = base, 1
    while name in taken:
        n += 1
        name = f"{base}-{n}"
    return name
