"""The Triton path's host-side packing: decode page tables kept between steps (no model)."""

from __future__ import annotations

import random

from yaied.core.request import SamplingParams
from yaied.core.step import ScheduledSeq
from yaied.worker.gpu_packing import DecodeTables, _table

PAGE = 4
PARAMS = SamplingParams(max_tokens=1)


def _decode(request_id: str, pages: list[int], context: int) -> ScheduledSeq:
    """A decode row at position `context` (its pages cover context + 1 tokens)."""
    return ScheduledSeq(request_id, [7], context, pages, True, PARAMS)


def test_kept_tables_follow_every_kind_of_change_to_a_page_list():
    """Random steps over live page lists, mutated the ways the cache manager mutates them: a
    page appended as the context grows, a prefix swapped for the tree's pages in place, drafts'
    pages trimmed and others allocated, a new list after preemption, a request sitting steps
    out. Every step's table must equal the one built from scratch."""
    rng = random.Random(0)
    tables = DecodeTables()
    fresh_page = iter(range(1000, 10**9))
    requests = {f"r{i}": ([next(fresh_page) for _ in range(3)], 3 * PAGE - 1) for i in range(12)}
    for _ in range(400):
        for rid, (pages, context) in list(requests.items()):
            change = rng.random()
            if change < 0.5:
                context += 1
                if context // PAGE >= len(pages):
                    pages.append(next(fresh_page))
            elif change < 0.6 and len(pages) > 1:
                pages[: len(pages) - 1] = [next(fresh_page) for _ in pages[:-1]]  # in place
            elif change < 0.7 and len(pages) > 1:
                del pages[-1]  # drafts' pages trimmed, another page given in their place
                pages.append(next(fresh_page))
            elif change < 0.75:
                context = rng.randrange(1, 6 * PAGE)  # preempted and back: a new list
                pages = [next(fresh_page) for _ in range(context // PAGE + 1)]
            requests[rid] = (pages, context)
        step = [
            _decode(rid, pages, context)
            for rid, (pages, context) in requests.items()
            if rng.random() < 0.9  # some sit this step out
        ]
        pad = rng.randrange(3)
        got, width = tables.table(step, PAGE, pad)
        want, want_width = _table(step, PAGE, pad)
        assert (width, list(got)) == (want_width, list(want))


def test_an_empty_step_gives_one_column_of_padding():
    tables, want = DecodeTables(), _table([], PAGE, 2)
    got = tables.table([], PAGE, 2)
    assert (list(got[0]), got[1]) == (list(want[0]), want[1]) == ([0, 0], 1)
