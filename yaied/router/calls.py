"""One call as the manager holds it, and the handle a Python caller gets back.

A call outlives its engine: the manager keeps the tokens its caller has (``output_ids``), and
a call whose engine goes resumes on another after them (manager.py, ``_give_up_on``).

The engine's events reach ``Call.sink`` through the manager's ``_deliver`` (lifecycle, KV
coordinator), with no queue or task in between. ``submit_request`` makes that sink one end of an
EventStream and wraps the other in a ``RequestHandle``, read as a stream or as one collected
result; leaving the stream before its final event cancels the call (core/stream.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from yaied.core.request import FinishReason, RequestOutput, SamplingParams, TokenEvent
from yaied.core.stream import EventSink, EventStream

# A call whose engine goes (removed, drained past its timeout, lost, its process dead) moves to
# another engine at most this many times; then it ends with an error event.
MAX_MOVES = 2


@dataclass(slots=True)
class Call:
    request_id: str  # the manager's key, unique among live calls: what the engine sees
    session_id: str | None
    prompt_ids: list[int]
    params: SamplingParams
    priority: int
    sink: EventSink  # where its events go, after the manager has recorded them
    client_id: str = ""  # the caller's name for it (X-Request-Id): shared by choices, not unique
    engine_id: str = ""
    cancelled: bool = False
    num_moves: int = 0  # times it left an engine for another (at most MAX_MOVES)
    streamed: bool = False  # an event with tokens reached the caller
    # The tokens the caller has: a move resumes after them (prompt + these recomputed, the
    # sampling state rebuilt from them by the next engine: AsyncEngine.add_request).
    output_ids: list[int] = field(default_factory=list)
    num_output_tokens: int = 0
    finished: bool = False
    # The daemons it passed through before this one (X-Yaied-Via), for a remote engine to pass
    # on: a daemon it comes back to refuses it (core/forwarding.py).
    via: tuple[str, ...] = ()

    @property
    def num_tokens(self) -> int:
        """Its weight in an engine's outstanding tokens."""
        return len(self.prompt_ids) + self.params.max_tokens

    def final_event(self, reason: FinishReason, error: str | None = None) -> TokenEvent:
        """A last event made by the router (the engine could not send one)."""
        return TokenEvent(
            self.request_id,
            [],
            "",
            reason,
            error=error,
            num_prompt_tokens=len(self.prompt_ids),
            num_output_tokens=self.num_output_tokens,
        )


class RequestHandle:
    """What ``EngineManager.submit_request`` returns: iterate it, or await ``result()``."""

    def __init__(
        self, call: Call, events: EventStream[None], cancel: Callable[[str], object]
    ) -> None:
        self._call = call
        self._events = events
        self._cancel = cancel

    @property
    def request_id(self) -> str:
        return self._call.request_id

    @property
    def client_id(self) -> str:
        return self._call.client_id

    @property
    def session_id(self) -> str | None:
        return self._call.session_id

    @property
    def engine_id(self) -> str:
        """The engine running the call now (it changes if the call is retried elsewhere)."""
        return self._call.engine_id

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        return self.stream()

    async def stream(self) -> AsyncIterator[TokenEvent]:
        """The call's events, the last with a finish reason. Closing early cancels the call."""
        async with contextlib.aclosing(self._events.events()) as events:
            async for _, event in events:
                yield event

    async def result(self) -> RequestOutput:
        """Every event collected into one output."""
        token_ids: list[int] = []
        text: list[str] = []
        last: TokenEvent | None = None
        async for event in self.stream():
            token_ids.extend(event.token_ids)
            text.append(event.text)
            last = event
        assert last is not None and last.finish_reason is not None
        return RequestOutput(
            self.request_id,
            list(self._call.prompt_ids),
            token_ids,
            "".join(text),
            last.finish_reason,
            last.stop_reason,
            last.num_cached_tokens,
            last.error,
        )

    async def cancel(self) -> None:
        self._cancel(self.request_id)
