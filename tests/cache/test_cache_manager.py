"""KVCacheManager: requests that skip the prefix lookup (prompt logprobs) still cache their pages.

A request scoring its prompt computes every position, so it takes no cached prefix; its computed
full pages still go into the tree, which swaps its prefix lock from the root to the new node. That
swap used to unlock ``None`` and crash the engine loop on the first prompt of one page or more.
"""

from __future__ import annotations

import pytest

from yaied.cache.cache_manager import KVCacheManager
from yaied.cache.page_pool import PagePool
from yaied.core.request import Request, SamplingParams

PAGE = 4


def make(num_pages: int = 32) -> tuple[KVCacheManager, PagePool]:
    pool = PagePool(num_pages, PAGE)
    return KVCacheManager(pool), pool


def request(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0))


def run_prefill(kv: KVCacheManager, req: Request, *, lookup: bool) -> None:
    """What the scheduler does for a whole-prompt chunk: match, reserve, compute, cache."""
    kv.match_prefix(req, lookup=lookup)
    todo = req.num_tokens - req.num_computed_tokens
    assert kv.reserve(req, todo)
    req.num_computed_tokens = req.num_tokens
    kv.cache(req)


def accounted(kv: KVCacheManager, pool: PagePool, live: list[Request]) -> int:
    owned = sum(len(r.page_ids) - r.num_shared_pages for r in live)
    return pool.num_free + kv.tree.num_cached_pages + owned


@pytest.mark.parametrize("prompt_len", [1, PAGE, PAGE + 1, 3 * PAGE + 2])
@pytest.mark.parametrize("shared", [False, True])
def test_request_without_lookup_caches_and_releases(prompt_len: int, shared: bool) -> None:
    kv, pool = make()
    prompt = list(range(1, prompt_len + 1))
    if shared:  # another request cached the same prompt first; the new one must not use it
        other = request("other", prompt)
        run_prefill(kv, other, lookup=True)
        kv.release(other, keep=True)
    req = request("scored", prompt)
    run_prefill(kv, req, lookup=False)
    assert req.num_cached_tokens == 0
    assert req.prefix_node is not None
    assert accounted(kv, pool, [req]) == pool.num_pages
    kv.release(req, keep=True)
    assert req.prefix_node is None and not req.page_ids
    # Everything is free or cached, and nothing cached is still locked.
    assert pool.num_free + kv.tree.num_cached_pages == pool.num_pages
    assert kv.tree.num_evictable_pages == kv.tree.num_cached_pages
    assert kv.tree.match_prefix(prompt).num_tokens == prompt_len // PAGE * PAGE


def test_cached_pages_of_a_scored_prompt_serve_a_later_request() -> None:
    kv, pool = make()
    prompt = list(range(1, 2 * PAGE + 3))
    scored = request("scored", prompt)
    run_prefill(kv, scored, lookup=False)
    later = request("later", prompt)
    kv.match_prefix(later)
    assert later.num_cached_tokens == 2 * PAGE
    assert later.page_ids == scored.page_ids[:2]
    kv.release(later, keep=False)
    kv.release(scored, keep=True)
    assert pool.num_free + kv.tree.num_cached_pages == pool.num_pages
