"""How the engine loop survives faults: levels 2 and 3 of the escalation (yaied/engine/faults.py),
and whether it is progressing (the systemd watchdog's question).

A mixin of `AsyncEngine`, kept apart like the loop (engine/step_loop.py); these methods run in
the engine task like the rest of it. Level 1 (one request fails alone) is
`OutputPhase._for_request` (engine/output.py) and the worker's per-row retry.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from yaied.core.config import EngineConfig
from yaied.core.request import FinishReason
from yaied.core.step import Batch
from yaied.engine.faults import EngineDeadError, check_invariants, restart_reason

if TYPE_CHECKING:
    import asyncio

    from yaied.engine.output import RequestStream
    from yaied.engine.scheduler import Scheduler

log = logging.getLogger(__name__)


class Recovery:
    """Uses the engine's state and its `_finish_stream`, `_end_stream`, `_new_bookkeeping`."""

    config: EngineConfig
    scheduler: Scheduler
    restarts: dict[str, int]
    dead: BaseException | None
    on_dead: Callable[[BaseException], None] | None
    _inbox: deque[RequestStream]
    _streams: dict[str, RequestStream]
    _compiling: dict[str, asyncio.Task[Any]]
    _failed_steps: int
    _last_progress: float  # the last finished step, or when work arrived
    _rebuilds_in_a_row: int
    _num_queued: int

    def _fail_step(self, batch: Batch, error: str) -> None:
        """Nothing of the step ran: its requests fail. Steps failing over and over point at the
        bookkeeping (a page table the model cannot use): rebuild it."""
        for seq in batch.seqs:
            self._finish_stream(seq.request_id, FinishReason.ERROR, error=error)
        self._failed_steps += 1
        limit = self.config.engine.max_failed_steps
        if self._failed_steps >= limit:
            self._failed_steps = 0
            self._rebuild("failed_steps", RuntimeError(f"{limit} steps failed in a row: {error}"))

    def _guarded(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a piece of the loop; an exception escaping it is level 2 (rebuild, return None),
        or level 3 when it is EngineDeadError or the rebuild fails (stop, raise)."""
        try:
            return fn(*args)
        except EngineDeadError as exc:
            self._die(exc)
            raise
        except Exception as exc:
            try:
                self._rebuild(restart_reason(exc), exc)
            except Exception as failed:
                dead = EngineDeadError(f"could not recover from {exc!r}: {failed}")
                self._die(dead)
                raise dead from failed
            return None

    def _rebuild(self, reason: str, exc: BaseException) -> None:
        """Level 2: fail the in-flight requests, start over with empty bookkeeping. Requests
        still in the inbox never reached the scheduler; they are served after the rebuild."""
        log.error("engine restart (%s): %s", reason, exc, exc_info=exc)
        self._rebuilds_in_a_row += 1
        if self._rebuilds_in_a_row > self.config.engine.max_failed_steps:
            raise EngineDeadError(f"{self._rebuilds_in_a_row} rebuilds with no good step between")
        self.restarts[reason] += 1
        error = f"the engine failed ({reason}: {exc}) and restarted; retry the request"
        queued = {id(stream) for stream in self._inbox}
        for request_id, stream in list(self._streams.items()):
            if id(stream) not in queued and request_id not in self._compiling:
                self._end_stream(stream, FinishReason.ERROR, error)
        self._failed_steps = 0
        self._new_bookkeeping()
        check_invariants(self.scheduler, len(self._streams), self._num_queued)

    def _die(self, exc: BaseException) -> None:
        """Level 3: fail every request, refuse new ones, tell on_dead (once)."""
        if self.dead is not None:
            return
        log.critical("engine stopped: %s", exc)
        self.dead = exc
        self._inbox.clear()
        for task in self._compiling.values():
            task.cancel()
        self._compiling.clear()
        for stream in list(self._streams.values()):
            self._end_stream(stream, FinishReason.ERROR, f"the engine stopped: {exc}")
        if self.on_dead is not None:
            try:
                self.on_dead(exc)
            except Exception:
                log.exception("on_dead failed")

    def progressing(self) -> bool:
        """Whether steps advance: nothing is pending, or a step finished (or work arrived) less
        than engine.step_timeout_s ago. The systemd watchdog is fed only while this holds."""
        if self.dead is not None:
            return False
        if not self._streams:
            return True
        return time.monotonic() - self._last_progress < self.config.engine.step_timeout_s
