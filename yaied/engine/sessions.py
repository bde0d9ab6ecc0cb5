"""Per-call and per-session accounting: what each program (session) has received so far.

A program is the chain of LLM calls an agent makes under one session id. PLAS ranks a call by its
program's attained service, the summed model-execution time of the program's completed calls, so
short programs overtake long ones without anyone knowing lengths in advance.

Parallel calls (ATLAS) keep one scalar per session. A call inherits the session's service when it
arrives; when it completes, service = max(service, inherited + the call's own model time). For
sequential calls that is the plain sum; for a wave of parallel calls it is the longest path through
the wave, so a wide program is not punished for its width.

For the anti-starvation rule the table also sums, over completed calls, the time spent queued (W)
and the time spent admitted and running (T). Entries of idle sessions (no call in flight for
``idle_expiry_s``) are dropped: a session id that comes back later starts from zero, as a new
program would.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class CallStats:
    """One call's account. Its life alternates between queued and running intervals (a
    preempted call queues again); ``since`` is when the current interval began."""

    session_id: str | None  # None: the call is a program of its own
    inherited: float  # the session's service when the call arrived (0 without ATLAS)
    since: float
    model_time: float = 0.0  # model time of the steps this call ran in
    waiting: float = 0.0  # closed queued intervals
    running: float = 0.0  # closed running intervals
    is_running: bool = False
    promoted_at: float = 0.0  # service at its last anti-starvation promotion (0: never)
    admitted_at: float = 0.0  # model_time when last admitted

    @property
    def service(self) -> float:
        return self.inherited + self.model_time

    def switch(self, now: float, *, running: bool) -> None:
        """Close the current interval and open one of the other kind."""
        if running == self.is_running:
            return
        if self.is_running:
            self.running += now - self.since
        else:
            self.waiting += now - self.since
        self.is_running = running
        self.since = now

    def waited(self, now: float) -> float:
        return self.waiting + (0.0 if self.is_running else now - self.since)

    def ran(self, now: float) -> float:
        return self.running + (now - self.since if self.is_running else 0.0)


@dataclass(slots=True)
class SessionStats:
    service: float = 0.0  # attained service, the ATLAS scalar (seconds of model time)
    waiting: float = 0.0  # summed queued time of completed calls (W_session)
    running: float = 0.0  # summed running time of completed calls (T_session)
    num_active: int = 0  # calls that arrived and have not finished
    num_calls: int = 0  # calls completed
    last_active: float = 0.0  # when a call last arrived or finished


class SessionTable:
    def __init__(self, idle_expiry_s: float) -> None:
        if not idle_expiry_s > 0:
            raise ValueError(f"session idle expiry must be > 0 seconds, got {idle_expiry_s}")
        self.idle_expiry_s = idle_expiry_s
        self._sessions: dict[str, SessionStats] = {}
        self._last_sweep = float("-inf")

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, session_id: str | None) -> SessionStats | None:
        return None if session_id is None else self._sessions.get(session_id)

    def arrive(self, session_id: str, now: float) -> float:
        """A call of the session arrives: returns the service it inherits (ATLAS)."""
        # Sweep a few times per expiry period, so arrivals stay O(1) on average however many
        # sessions the table holds.
        if now - self._last_sweep >= self.idle_expiry_s / 4:
            self.expire(now)
        stats = self._sessions.get(session_id)
        if stats is None:
            stats = self._sessions[session_id] = SessionStats()
        stats.num_active += 1
        stats.last_active = now
        return stats.service

    def complete(self, call: CallStats, now: float) -> None:
        """A call that ``arrive`` counted has finished (any reason): fold it into its session."""
        stats = self.get(call.session_id)
        if stats is None:
            return  # a call without a session: nothing to remember
        stats.service = max(stats.service, call.service)
        stats.waiting += call.waited(now)
        stats.running += call.ran(now)
        stats.num_active -= 1
        stats.num_calls += 1
        stats.last_active = now

    def expire(self, now: float) -> None:
        """Drop sessions with no call in flight that have been idle longer than the expiry."""
        self._last_sweep = now
        stale = [
            sid
            for sid, s in self._sessions.items()
            if s.num_active == 0 and now - s.last_active > self.idle_expiry_s
        ]
        for sid in stale:
            del self._sessions[sid]
