"""Calls that outlive their engine: the manager's (manager.py) moves.

A call whose engine goes (lost, its process dead, removed or drained past its timeout: pool.py)
moves to another engine, streamed tokens or not: the next engine recomputes the prompt plus the
tokens the caller has and goes on from there with the same sampling state (preemption across
engines), so the caller reads one stream. At most MAX_MOVES moves; with no engine to move to,
or after them, the call ends FAILED with an error event.
"""

from __future__ import annotations

import logging

from yaied.core.request import FinishReason
from yaied.router.calls import MAX_MOVES, Call
from yaied.router.handle import EngineHandle
from yaied.router.lifecycle import LifecycleTracker

log = logging.getLogger(__name__)


class CallMigration:
    # The manager's tables and methods this mixin uses: _dispatch, _route, _deliver
    # (manager.py).
    _outstanding: dict[str, dict[str, int]]
    lifecycle: LifecycleTracker

    def _init_migration(self) -> None:
        # Calls moved off an engine ("moved"), and those that could not be ("failed": no engine
        # to take them, or moved MAX_MOVES times): yaied:call_migrations_total{outcome}.
        self.migrations = {"moved": 0, "failed": 0}

    def _lost(self, call: Call, engine_id: str, move: int, reason: str) -> None:
        """The engine running the call was lost before its final event."""
        if call.finished or call.engine_id != engine_id or call.num_moves != move:
            return  # already moved elsewhere, or finished
        self._dispatch(call, self._give_up_on(call, engine_id, reason))

    def _give_up_on(self, call: Call, engine_id: str, reason: str) -> EngineHandle | None:
        """The engine cannot run the call: another engine to move it to, or None after
        failing it with an error event (it was cancelled, it moved MAX_MOVES times, or no
        other engine can take it now)."""
        self._outstanding[engine_id].pop(call.request_id, None)
        if call.num_moves >= MAX_MOVES:
            reason = f"{reason} (the call had moved {call.num_moves} times already)"
        movable = not call.cancelled and call.num_moves < MAX_MOVES
        next_engine = self._route(call, {engine_id}) if movable else None
        if next_engine is None:
            if call.cancelled:  # its client's cancel, which the lost engine never confirmed
                self._deliver(call, call.final_event(FinishReason.ABORT))
                return None
            self.migrations["failed"] += 1
            self._deliver(call, call.final_event(FinishReason.ERROR, reason))
            return None
        num_sent = len(call.output_ids)
        log.warning(
            "%s: %s; moving it to engine %s after %d sent tokens",
            call.request_id,
            reason,
            next_engine.engine_id,
            num_sent,
        )
        call.num_moves += 1
        self.migrations["moved"] += 1
        self.lifecycle.record_move(call.request_id, engine_id, next_engine.engine_id, num_sent)
        return next_engine
