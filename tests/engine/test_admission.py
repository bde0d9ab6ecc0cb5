"""admission.py: what a waiting request may count on, victims' shared pages included."""

from __future__ import annotations

from types import SimpleNamespace

from yaied.engine.admission import room_for_rest


def _request(rid: str, pages: list[int], num_tokens: int = 0) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, page_ids=pages, num_tokens=num_tokens)


def _scheduler(running: list[SimpleNamespace], free: int) -> SimpleNamespace:
    return SimpleNamespace(
        running=running,
        pool=SimpleNamespace(pages_for=lambda tokens: -(-tokens // 4)),
        policy=SimpleNamespace(preemptive=True, preemptible=lambda r: True),
        cache=SimpleNamespace(num_free_pages=free),
    )


def test_pages_shared_with_others_are_not_counted_as_freed():
    prefix = list(range(8))  # a system prompt's pages, held by everyone who matched it
    victims = [_request("v1", prefix + [20, 21, 22, 23]), _request("v2", prefix + [30, 31, 32, 33])]
    keeper = _request("top", prefix + [40])  # ranked above the newcomer: kept running
    newcomer = _request("new", prefix, num_tokens=4 * 17)  # 17 pages, 8 of them matched
    scheduler = _scheduler([keeper, *victims], free=0)
    ranks = {"top": 0, "new": 1, "v1": 2, "v2": 2}
    # Preempting v1 and v2 frees their own 8 pages, not the prefix (counted 3 times before).
    assert not room_for_rest(scheduler, newcomer, set(), ranks)  # needs 9
    assert room_for_rest(_scheduler([keeper, *victims], free=1), newcomer, set(), ranks)
