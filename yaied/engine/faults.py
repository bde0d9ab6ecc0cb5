"""What the engine loop does when something breaks: one escalation order, three levels.

1. One request's own handling fails (detokenizer, stop strings, logprob formatting, a row the
   worker could not run even alone, non-finite values): that request ends with an error event and
   gives back its pages; the rest of the step and the engine go on.
2. The bookkeeping cannot be trusted: an exception inside the scheduler, the prefix cache or the
   page pool, a failed invariant check (`check_invariants`), or `engine.max_failed_steps` whole
   steps failing in a row. The engine fails its in-flight requests, builds a new page pool,
   prefix cache and scheduler in-process, and serves again (counted by reason in
   `yaied:engine_restarts_total`).
3. The process cannot serve any more: the rebuild itself failed (or rebuilds follow each other
   with no good step between them), the device reported a CUDA error, or a step ran past
   `engine.step_timeout_s`. `EngineDeadError`: the engine fails everything and stops; a
   single-engine daemon exits non-zero for its supervisor to restart it, and an engine process
   exits for the router to restart it.

This module is plain Python over the scheduler's state, so the checks run on every step.
"""

from __future__ import annotations

import traceback

from yaied.engine.scheduler import Scheduler

# Why the engine rebuilt its bookkeeping (the `reason` label of engine_restarts_total).
RESTART_REASONS = ("cache_error", "loop_error", "invariant", "failed_steps")


class EngineDeadError(RuntimeError):
    """The engine cannot serve any more in this process: restart the process."""


class InvariantError(RuntimeError):
    """The scheduler's or the cache's state contradicts itself: pages leaked or double-owned, a
    request that can never finish."""


def restart_reason(exc: BaseException) -> str:
    """`cache_error` when the exception was raised inside yaied/cache (the page pool, the radix
    tree, the KV cache manager), `invariant` for a failed check, else `loop_error`."""
    if isinstance(exc, InvariantError):
        return "invariant"
    for frame in traceback.extract_tb(exc.__traceback__):
        if "/yaied/cache/" in frame.filename.replace("\\", "/"):
            return "cache_error"
    return "loop_error"


def check_invariants(scheduler: Scheduler, num_streams: int, num_queued: int) -> None:
    """Raise InvariantError unless every page is free, cached or owned by exactly one running
    request, waiting requests hold no pages, and every open stream belongs to a request that is
    queued for the scheduler or known to it (else it would never get another event).

    O(running requests): cheap enough for every step.

        pool.num_pages == free + cached (the tree's) + owned (running requests' own pages)
    """
    cache = scheduler.cache
    owned = 0
    for request in scheduler.running:
        if request.prefix_node is None:
            raise InvariantError(f"running request {request.request_id} locks no prefix node")
        if not 0 <= request.num_shared_pages <= len(request.page_ids):
            raise InvariantError(f"request {request.request_id}: bad shared page count")
        owned += len(request.page_ids) - request.num_shared_pages
    for request in scheduler.waiting:
        if request.page_ids or request.prefix_node is not None:
            raise InvariantError(f"waiting request {request.request_id} holds pages")
    free, cached, total = cache.pool.num_free, cache.tree.num_cached_pages, cache.pool.num_pages
    if free + cached + owned != total:
        raise InvariantError(
            f"KV pages do not add up: {free} free + {cached} cached + {owned} owned by "
            f"running requests != {total}"
        )
    if cache.tree.num_evictable_pages > cached:
        raise InvariantError("more evictable pages than cached ones")
    known = len(scheduler.requests)
    if known != len(scheduler.running) + len(scheduler.waiting):
        raise InvariantError("the scheduler lost track of a request")
    if num_streams != known + num_queued:
        raise InvariantError(
            f"{num_streams} open streams for {known} scheduled and {num_queued} queued requests"
        )
