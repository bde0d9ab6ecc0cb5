"""The API key table: who may call the daemon, and what each caller may do.

Keys come from ``server.api_keys`` and ``server.api_key_file``, one entry each, in one format:

    <secret> [name=<name>] [admin=true|false] [may_set_priority=true|false] [max_in_flight=<n>]

A bare secret (the older format) is a key with no rights beyond calling the API: named
``key<i>`` by its place in the table, no admin, its ``priority`` ignored, no bound of its own on
requests in flight. With keys set, every request and session id is namespaced by the caller's key
(``scoped_id``), so no key can cancel, read or join another key's work: to it, that work is
absent. The table is pure data (no web framework), so any layer may read it: the auth middleware
(server/auth.py) and the admin routes (server/engines_routes.py).
"""

from __future__ import annotations

import hmac
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
_FLAGS = ("admin", "may_set_priority")


@dataclass(frozen=True, slots=True)
class ApiKey:
    name: str  # in logs and in the namespace of the key's ids; never the secret
    secret: str = field(repr=False)
    admin: bool = False  # may change the engines: add, drain, remove (engines_routes.py)
    may_set_priority: bool = False  # the request's `priority` is honoured; else it is 0
    max_in_flight: int = 0  # generation requests at once; past it, 429; 0 = no bound of its own


class KeyTable:
    """The keys, found by secret in constant time per key (compare_digest against every one)."""

    def __init__(self, keys: Iterable[ApiKey] = ()) -> None:
        self.keys = tuple(keys)
        names = [key.name for key in self.keys]
        secrets = [key.secret for key in self.keys]
        if len(set(names)) != len(names):
            raise ValueError("server API keys: two keys share a name")
        if len(set(secrets)) != len(secrets):
            raise ValueError("server API keys: a secret is listed twice with different settings")
        self._secrets = [secret.encode() for secret in secrets]
        # key name -> its generation requests running (the auth middleware's count, which
        # max_in_flight bounds), background responses included until they end
        self.in_flight: Counter[str] = Counter()

    @classmethod
    def parse(cls, entries: Iterable[str]) -> KeyTable:
        """The table from entries in the format above (blank entries and # comments skipped);
        ValueError names the entry at fault, never its secret."""
        keys = []
        for line in entries:
            line = line.strip()
            if line and not line.startswith("#"):
                keys.append(parse_entry(line, default_name=f"key{len(keys) + 1}"))
        return cls(keys)

    def replace(self, other: KeyTable) -> None:
        """Take ``other``'s keys (a reload): the middleware holds this table, so the next
        request is checked against the new keys. On the event loop, between requests. The
        requests in flight stay counted."""
        self.keys, self._secrets = other.keys, other._secrets

    def hold(self, name: str) -> None:
        """One more request of key ``name`` in flight."""
        self.in_flight[name] += 1

    def release(self, name: str) -> None:
        self.in_flight[name] -= 1
        if not self.in_flight[name]:
            del self.in_flight[name]

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def lookup(self, token: bytes) -> ApiKey | None:
        # Every key is compared: the time taken says nothing about which one is close.
        found = None
        for key, secret in zip(self.keys, self._secrets, strict=True):
            if hmac.compare_digest(token, secret):
                found = key
        return found


def parse_entry(line: str, *, default_name: str) -> ApiKey:
    secret, *fields = line.split()
    values: dict[str, object] = {"name": default_name}
    for item in fields:
        name, sep, value = item.partition("=")
        where = f"server API key {values['name']!r}: {item!r}"
        if not sep:
            raise ValueError(f"{where} is not name=value")
        if name == "name":
            if not _NAME.fullmatch(value):
                raise ValueError(f"{where}: names are 1 to 64 of [A-Za-z0-9._-]")
            values["name"] = value
        elif name in _FLAGS:
            if value not in ("true", "false"):
                raise ValueError(f"{where}: {name} is true or false")
            values[name] = value == "true"
        elif name == "max_in_flight":
            if not value.isdecimal():
                raise ValueError(f"{where}: max_in_flight is a whole number (0: no bound)")
            values[name] = int(value)
        else:
            raise ValueError(f"{where}: unknown setting {name!r}")
    return ApiKey(secret=secret, **values)  # type: ignore[arg-type]


def scoped_id(key: ApiKey | None, client_id: str) -> str:
    """A client's request or session id in its key's namespace: ``<key name>:<id>``. Names have
    no ``:``, so two keys' ids never meet whatever they send. Without keys: the id itself."""
    return client_id if key is None else f"{key.name}:{client_id}"
