"""Which session has KV cache on which engine, and how often engines find prompts in cache.

The router never sees the engines' radix trees; it learns from what they report. Each finished call
records (session, engine, prompt tokens, cached tokens): the session's context now sits on that
engine, and the cached tokens say how much of the prompt the engine already had. Pins (the engine
a session's long calls go to) live here too, and are dropped when their engine is lost.

Sessions are kept in least-recently-used order and at most ``max_sessions`` of them, so memory
stays bounded.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(slots=True)
class HitCounter:
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0

    def add(self, prompt: int, cached: int) -> None:
        self.num_prompt_tokens += prompt
        self.num_cached_tokens += cached

    @property
    def hit_rate(self) -> float:
        return self.num_cached_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0


@dataclass(slots=True)
class SessionCache:
    pin: str | None = None  # where the session's long calls go
    # engine id -> tokens of the session's latest context there (prompt + output of its last call)
    context_tokens: dict[str, int] = field(default_factory=dict)
    hits: HitCounter = field(default_factory=HitCounter)


class KVCoordinator:
    def __init__(self, *, max_sessions: int = 65_536) -> None:
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, SessionCache] = OrderedDict()
        self._engines: dict[str, HitCounter] = {}

    def _session(self, session_id: str) -> SessionCache:
        entry = self._sessions.get(session_id)
        if entry is None:
            entry = self._sessions[session_id] = SessionCache()
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        self._sessions.move_to_end(session_id)
        return entry

    def pin_of(self, session_id: str | None) -> str | None:
        if session_id is None:
            return None
        entry = self._sessions.get(session_id)
        return None if entry is None else entry.pin

    def set_pin(self, session_id: str | None, engine_id: str) -> None:
        if session_id is not None:
            self._session(session_id).pin = engine_id

    def record(
        self,
        session_id: str | None,
        engine_id: str,
        num_prompt_tokens: int,
        num_cached_tokens: int,
        num_output_tokens: int = 0,
    ) -> None:
        """One call finished on ``engine_id``: count its hits, note where its context lives."""
        self._engines.setdefault(engine_id, HitCounter()).add(num_prompt_tokens, num_cached_tokens)
        if session_id is None:
            return
        entry = self._session(session_id)
        entry.hits.add(num_prompt_tokens, num_cached_tokens)
        entry.context_tokens[engine_id] = num_prompt_tokens + num_output_tokens

    def engine_lost(self, engine_id: str) -> int:
        """The engine's cache is gone (it died or restarted): drop its pins and contexts. Returns
        how many pins were cleared."""
        cleared = 0
        for entry in self._sessions.values():
            entry.context_tokens.pop(engine_id, None)
            if entry.pin == engine_id:
                entry.pin = None
                cleared += 1
        return cleared

    def engines_with(self, session_id: str) -> dict[str, int]:
        """Engine id -> tokens of the session's context cached there (as last reported)."""
        entry = self._sessions.get(session_id)
        return {} if entry is None else dict(entry.context_tokens)

    def engine_hit_rate(self, engine_id: str) -> float:
        counter = self._engines.get(engine_id)
        return 0.0 if counter is None else counter.hit_rate

    def session_hit_rate(self, session_id: str) -> float:
        entry = self._sessions.get(session_id)
        return 0.0 if entry is None else entry.hits.hit_rate

    def totals(self) -> HitCounter:
        total = HitCounter()
        for counter in self._engines.values():
            total.add(counter.num_prompt_tokens, counter.num_cached_tokens)
        return total

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)
