"""The lifecycle of every call the router has seen: a small state machine with timestamps.

    PENDING --first event--> RUNNING --> COMPLETED (stop, length)
       |                        |------> CANCELLED (abort)
       +--> CANCELLED | FAILED  +------> FAILED    (engine error, engine lost)

A call that moves to another engine (its engine was lost or removed) keeps its state; the move
is recorded (``moves``: from, to, tokens sent by then) and ``engine_id`` names the new engine.

Records are keyed by the call's own id (unique among live calls) and carry the client's id
(``X-Request-Id``), which several calls may share: the choices of one request, or requests of
clients that picked the same id. ``by_client_id`` finds them all.

Waiting time is PENDING -> RUNNING, service time RUNNING -> end. Finished records stay queryable
for ``ttl_seconds`` and at most ``max_finished`` of them are kept, so memory stays bounded however
long the daemon runs. Illegal transitions raise: a call that ended never moves again.
"""

from __future__ import annotations

import enum
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field


class CallState(enum.Enum):
    PENDING = "pending"
    RUNNING = "running"
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    FAILED = "failed"

    @property
    def finished(self) -> bool:
        return self in _FINAL


_FINAL = frozenset({CallState.COMPLETED, CallState.CANCELLED, CallState.FAILED})
_ALLOWED: dict[CallState, frozenset[CallState]] = {
    CallState.PENDING: frozenset({CallState.RUNNING, CallState.CANCELLED, CallState.FAILED}),
    CallState.RUNNING: _FINAL,
}


class IllegalTransition(ValueError):
    """A move the state machine does not allow (say COMPLETED -> RUNNING)."""


@dataclass(frozen=True, slots=True)
class CallMove:
    """A call left ``from_engine`` for ``to_engine`` after ``num_sent_tokens`` tokens."""

    from_engine: str
    to_engine: str
    num_sent_tokens: int
    at: float


@dataclass(slots=True)
class CallRecord:
    request_id: str
    session_id: str | None
    num_prompt_tokens: int
    created_at: float
    state: CallState = CallState.PENDING
    engine_id: str | None = None
    started_at: float | None = None
    finished_at: float | None = None
    num_output_tokens: int = 0
    error: str | None = None
    client_id: str = ""  # the client's request id (X-Request-Id); the call's own when none
    moves: list[CallMove] = field(default_factory=list)  # engines it left, oldest first

    @property
    def waiting_time(self) -> float | None:
        """Seconds from submission to the first event (None while pending)."""
        return None if self.started_at is None else self.started_at - self.created_at

    @property
    def service_time(self) -> float | None:
        """Seconds from the first event to the end (None until it ended after running)."""
        if self.started_at is None or self.finished_at is None:
            return None
        return self.finished_at - self.started_at


class LifecycleTracker:
    def __init__(
        self,
        *,
        ttl_seconds: float = 600.0,
        max_finished: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_seconds = ttl_seconds
        self.max_finished = max_finished
        self._clock = clock
        self._live: dict[str, CallRecord] = {}
        # Finished records in the order they finished: the oldest expire first.
        self._finished: OrderedDict[str, CallRecord] = OrderedDict()

    def add(
        self,
        request_id: str,
        session_id: str | None,
        num_prompt_tokens: int,
        client_id: str | None = None,
    ) -> CallRecord:
        if request_id in self._live:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._finished.pop(request_id, None)  # an id may be reused once its call has ended
        record = CallRecord(
            request_id,
            session_id,
            num_prompt_tokens,
            self._clock(),
            client_id=request_id if client_id is None else client_id,
        )
        self._live[request_id] = record
        return record

    def transition(
        self,
        request_id: str,
        state: CallState,
        *,
        engine_id: str | None = None,
        num_output_tokens: int | None = None,
        error: str | None = None,
    ) -> CallRecord:
        record = self._live.get(request_id)
        if record is None:
            ended = self._finished.get(request_id)
            where = f"it ended {ended.state.value}" if ended is not None else "it is unknown"
            raise IllegalTransition(f"request {request_id!r} cannot become {state.value}: {where}")
        if state not in _ALLOWED[record.state]:
            raise IllegalTransition(
                f"request {request_id!r}: {record.state.value} -> {state.value} is not allowed"
            )
        now = self._clock()
        record.state = state
        if engine_id is not None:
            record.engine_id = engine_id
        if num_output_tokens is not None:
            record.num_output_tokens = num_output_tokens
        if error is not None:
            record.error = error
        if state is CallState.RUNNING:
            record.started_at = now
        else:
            record.finished_at = now
            del self._live[request_id]
            self._finished[request_id] = record
            self.expire()
        return record

    def record_move(
        self, request_id: str, from_engine: str, to_engine: str, num_sent_tokens: int
    ) -> CallRecord:
        """A live call moved to another engine; its state does not change."""
        record = self._live.get(request_id)
        if record is None:
            raise IllegalTransition(f"request {request_id!r} cannot move: it is not live")
        record.moves.append(CallMove(from_engine, to_engine, num_sent_tokens, self._clock()))
        record.engine_id = to_engine
        return record

    def get(self, request_id: str) -> CallRecord | None:
        """The record of one call, by the call's own id."""
        return self._live.get(request_id) or self._finished.get(request_id)

    def by_client_id(self, client_id: str) -> list[CallRecord]:
        """Every known call whose client id is exactly ``client_id``, oldest first."""
        self.expire()
        records = [*self._live.values(), *self._finished.values()]
        found = [record for record in records if record.client_id == client_id]
        return sorted(found, key=lambda record: record.created_at)

    def by_state(self, state: CallState) -> list[CallRecord]:
        self.expire()
        pool = self._finished.values() if state.finished else self._live.values()
        return [record for record in pool if record.state is state]

    def by_session(self, session_id: str) -> list[CallRecord]:
        self.expire()
        records = [*self._live.values(), *self._finished.values()]
        return [record for record in records if record.session_id == session_id]

    def live(self) -> list[CallRecord]:
        return list(self._live.values())

    def expire(self) -> None:
        """Forget finished records older than the TTL, and the oldest beyond max_finished."""
        deadline = self._clock() - self.ttl_seconds
        while self._finished:
            oldest = next(iter(self._finished.values()))
            if len(self._finished) <= self.max_finished and oldest.finished_at > deadline:
                break
            self._finished.popitem(last=False)

    def __len__(self) -> int:
        return len(self._live) + len(self._finished)
