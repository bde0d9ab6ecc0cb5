"""Queue policies: in which order the scheduler serves calls, and whom it preempts.

The scheduler walks the running and waiting calls in ``rank`` order (lower first; equal ranks keep
queue order: arrival, with preempted calls at the front) and gives each its tokens while the step's
token budget and the free pages allow. A running call that needs a page preempts the worst-ranked
running call not yet in the step; under a ``preemptive`` policy a waiting call may also preempt
running calls of a strictly worse rank when pages run out.

- ``fcfs``: arrival order; running calls before waiting ones.
- ``priority``: the request's explicit priority, lower first (as vLLM), then arrival.
- ``mlfq``: K queues over discretised service, geometric quanta. Every new call enters the top
  queue and is demoted as its own model time uses up each queue's quantum.
- ``plas``: the same queues over the program's attained service: a call enters at the queue of
  its session's service (ATLAS: it inherits the session's scalar), so calls of programs that have
  already run a lot wait behind those of programs that have not.

Under mlfq and plas a call whose program has waited too long relative to how long it ran,
(W_session + W_call) / (T_session + T_call) >= beta, is promoted to the top queue (W: time
queued, T: time admitted and running; session terms over completed calls), so a long program is
never starved by a stream of short ones. A promoted call starts over at the top and is demoted
again by the service it receives from then on, like a new call.

Two rules keep preemption from thrashing (two calls taking each other's pages every step, each
recomputing its prefix): promotion sticks as just said, and a waiting call may only preempt a
running call that has had at least the top queue's quantum of service since it was admitted.
"""

from __future__ import annotations

import bisect

from yaied.core.config import SchedulerConfig
from yaied.core.request import Request
from yaied.engine.sessions import CallStats, SessionStats, SessionTable

Rank = tuple[float, ...]


class FCFSPolicy:
    """Arrival order. The base of the others: every hook is a no-op."""

    name = "fcfs"
    preemptive = False  # may a waiting call take pages from running calls of a worse rank
    reorders = False  # does rank ever differ between calls (else the sort can be skipped)

    def rank(self, request: Request, now: float) -> Rank:
        return ()

    def preemptible(self, request: Request) -> bool:
        """May a waiting call of a better rank take this running call's pages?"""
        return self.preemptive

    def on_add(self, request: Request, now: float) -> None:
        """The call entered the waiting queue for the first time."""

    def on_admit(self, request: Request, now: float) -> None:
        """The call was admitted (first time, or again after a preemption)."""

    def on_preempt(self, request: Request, now: float) -> None:
        """The call went back to the waiting queue."""

    def on_step(self, request: Request, model_time: float) -> None:
        """The call's share of one step's model-execution time."""

    def on_finish(self, request: Request, now: float) -> None:
        """The call ended, for any reason."""


class PriorityPolicy(FCFSPolicy):
    name = "priority"
    reorders = True

    def rank(self, request: Request, now: float) -> Rank:
        return (request.priority,)


class MultiLevelPolicy(FCFSPolicy):
    """mlfq (``inherit=False``) and plas (``inherit=True``)."""

    preemptive = True
    reorders = True

    def __init__(self, config: SchedulerConfig, *, inherit: bool) -> None:
        self.name = "plas" if inherit else "mlfq"
        self.inherit = inherit
        self.bounds = queue_bounds(config.num_queues, config.base_quantum_s, config.quantum_growth)
        self.beta = config.starvation_beta
        self.min_run = config.base_quantum_s
        self.sessions = SessionTable(config.session_idle_expiry_s)
        self.calls: dict[str, CallStats] = {}

    def rank(self, request: Request, now: float) -> Rank:
        call = self.calls[request.request_id]
        if is_starving(call, self.sessions.get(call.session_id), now, self.beta):
            call.promoted_at = call.service  # back to the top queue, as if new
        return (queue_level(call.service - call.promoted_at, self.bounds),)

    def preemptible(self, request: Request) -> bool:
        call = self.calls[request.request_id]
        return call.model_time - call.admitted_at >= self.min_run

    def on_add(self, request: Request, now: float) -> None:
        session_id = request.session_id
        inherited = 0.0
        if session_id is not None:
            service = self.sessions.arrive(session_id, now)
            inherited = service if self.inherit else 0.0
        # Queued since it arrived (the engine may add it a moment later).
        since = min(request.arrival_time, now)
        self.calls[request.request_id] = CallStats(session_id, inherited, since)

    def on_admit(self, request: Request, now: float) -> None:
        call = self.calls[request.request_id]
        call.switch(now, running=True)
        call.admitted_at = call.model_time

    def on_preempt(self, request: Request, now: float) -> None:
        self.calls[request.request_id].switch(now, running=False)

    def on_step(self, request: Request, model_time: float) -> None:
        self.calls[request.request_id].model_time += model_time

    def on_finish(self, request: Request, now: float) -> None:
        call = self.calls.pop(request.request_id, None)
        if call is not None:
            self.sessions.complete(call, now)


QueuePolicy = FCFSPolicy  # the interface every policy implements
POLICIES = ("fcfs", "priority", "mlfq", "plas")


def make_policy(config: SchedulerConfig) -> QueuePolicy:
    if config.policy == "fcfs":
        return FCFSPolicy()
    if config.policy == "priority":
        return PriorityPolicy()
    if config.policy in ("mlfq", "plas"):
        return MultiLevelPolicy(config, inherit=config.policy == "plas")
    known = ", ".join(POLICIES)
    raise ValueError(f"scheduler.policy must be one of {known}; got {config.policy!r}")


def queue_bounds(num_queues: int, base_quantum: float, growth: float) -> list[float]:
    """The service at which a call leaves each queue but the last: queue i holds calls with
    service in [bounds[i-1], bounds[i]). Quanta grow geometrically: q, q*g, q*g^2, ..."""
    bounds: list[float] = []
    total, quantum = 0.0, base_quantum
    for _ in range(num_queues - 1):
        total += quantum
        bounds.append(total)
        quantum *= growth
    return bounds


def queue_level(service: float, bounds: list[float]) -> int:
    """0 is the top queue; a call that has used up a queue's quantum is in the next one."""
    return bisect.bisect_right(bounds, service)


def is_starving(call: CallStats, session: SessionStats | None, now: float, beta: float) -> bool:
    """(W_session + W_call) / (T_session + T_call) >= beta, without dividing by zero: a call that
    has waited and never run (nor has its program) counts as starving."""
    waited = call.waited(now) + (session.waiting if session is not None else 0.0)
    ran = call.ran(now) + (session.running if session is not None else 0.0)
    return waited > 0 and waited >= beta * ran
