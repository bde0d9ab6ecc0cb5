"""The one stream: a request's events cross one queue from the engine loop to their reader.

Whoever produces events (the engine loop, an engine process's pipe reader, a remote daemon's SSE
reader) calls a sink, a plain function, on the event loop. The reader owns an EventStream and
hands out its sinks: one per call, tagged with a key (the choice an event belongs to), so the n
choices of one HTTP request share one queue. Iterating the stream yields ``(key, event)`` until
every call has sent its final event; leaving early, for any reason (client gone, cancellation,
an error), runs ``on_close`` once, which cancels what has not finished. This is the only place
that loop is written.

    engine loop --sink(event)--> EventStream.queue --async for--> SSE chunks / one JSON body
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Generic, TypeVar

from yaied.core.request import TokenEvent

K = TypeVar("K")

# Called with each event of one call, on the event loop: must be cheap and must not raise. One
# call's events pass through a chain of these, each hop a plain call (no queue until the last):
#   engine  OutputPhase -> RequestStream.sink              (engine/output.py)
#   router  handle -> CallSink.deliver = the manager's _deliver (lifecycle, KV coordinator)
#           -> Call.sink                                    (router/handle.py, router/manager.py)
#   server  Call.sink = _JobSink (metrics, the log line) -> EventStream.sink(key), the queue the
#           response reads                                  (server/serving.py, below)
EventSink = Callable[[TokenEvent], None]
# Told, instead of a final event, that the engine serving a call was lost (the reason).
LostSink = Callable[[str], None]
# One engine step's size in tokens (AsyncEngine.step_observer); a router handle tags it with its
# engine id (StepObserver) for the server's iteration_tokens histogram.
StepSizeSink = Callable[[int], None]
StepObserver = Callable[[str, int], None]


class EventStream(Generic[K]):
    def __init__(self, num_calls: int = 1, on_close: Callable[[], object] | None = None) -> None:
        """``num_calls``: final events to wait for; ``on_close``: run if the reader leaves
        before the last of them."""
        self._queue: asyncio.Queue[tuple[K, TokenEvent]] = asyncio.Queue()
        self._open_calls = num_calls
        self._on_close = on_close
        self._read = False

    def sink(self, key: K) -> EventSink:
        """The sink for one call's events."""

        def put(event: TokenEvent) -> None:
            self._queue.put_nowait((key, event))

        return put

    @property
    def done(self) -> bool:
        """Every call's final event has been read."""
        return self._open_calls == 0

    def drain(self) -> list[tuple[K, TokenEvent]]:
        """What has arrived so far, without waiting (for code that steps the engine itself)."""
        items = []
        while not self._queue.empty():
            items.append(self._take(self._queue.get_nowait()))
        return items

    def __aiter__(self) -> AsyncIterator[tuple[K, TokenEvent]]:
        return self.events()

    async def events(self) -> AsyncIterator[tuple[K, TokenEvent]]:
        """The events as they come. Close it (``contextlib.aclosing``) to leave early at once."""
        if self._read:
            raise RuntimeError("an event stream can be read only once")
        self._read = True
        try:
            while self._open_calls:
                yield self._take(await self._queue.get())
        finally:
            if self._open_calls and self._on_close is not None:
                self._on_close()

    def _take(self, item: tuple[K, TokenEvent]) -> tuple[K, TokenEvent]:
        if item[1].finished:
            self._open_calls -= 1
        return item
