"""What a waiting request may count on when the scheduler admits it (scheduler.py's `_admit`).

A prompt starts only when the pages free now, and those that preempting its possible victims
would free, hold all the tokens it still has to compute: admitted for its first chunk alone, a
prompt could run out of pages part-way, be preempted, and have its cached chunks evicted by the
next such prompt, over and over (two 5k-token prompts beside a decode computed 27x their tokens).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from yaied.cache.cache_manager import KVCacheManager
    from yaied.cache.page_pool import PagePool
    from yaied.core.request import Request
    from yaied.engine.policy import QueuePolicy, Rank


class Scheduler(Protocol):
    """What admission reads of the scheduler (scheduler.py's Scheduler)."""

    running: list[Request]
    policy: QueuePolicy
    pool: PagePool
    cache: KVCacheManager


def preemptible_by(
    scheduler: Scheduler, request: Request, scheduled: set[str], ranks: dict[str, Rank]
) -> list[Request]:
    """The running requests not yet in this step that waiting ``request`` may preempt: those
    ranked strictly worse, newest first."""
    mine, preemptible = ranks[request.request_id], scheduler.policy.preemptible
    running = [r for r in reversed(scheduler.running) if r.request_id not in scheduled]
    return [r for r in running if ranks[r.request_id] > mine and preemptible(r)]


def room_for_rest(
    scheduler: Scheduler, request: Request, scheduled: set[str], ranks: dict[str, Rank]
) -> bool:
    """Whether free pages, plus the pages only its possible victims hold, hold the rest of
    ``request``'s tokens. A page that the request itself or a request kept running also holds
    (a shared system prompt's) is not freed by preempting, so it is not counted."""
    need = scheduler.pool.pages_for(request.num_tokens) - len(request.page_ids)
    free = scheduler.cache.num_free_pages
    if need <= free or not scheduler.policy.preemptive:  # no walk over the running requests
        return need <= free
    victims = preemptible_by(scheduler, request, scheduled, ranks)
    ids = {r.request_id for r in victims}
    kept = [r.page_ids for r in scheduler.running if r.request_id not in ids]
    freed = {p for r in victims for p in r.page_ids}.difference(request.page_ids, *kept)
    return need <= free + len(freed)
