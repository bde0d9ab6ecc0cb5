from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    rule,
)

from yaied.cache.page_pool import PagePool
from yaied.cache.radix_cache import RadixCache, TreeNode


def make_cache(
    num_pages: int = 16, page_size: int = 2, enabled: bool = True
) -> tuple[PagePool, RadixCache]:
    pool = PagePool(num_pages, page_size)
    return pool, RadixCache(pool, enabled=enabled)


def cache_tokens(cache: RadixCache, pool: PagePool, tokens: list[int]) -> list[int]:
    """Allocate pages for ``tokens`` (whole pages) and hand all of them to the tree."""
    pages = pool.allocate(len(tokens) // pool.page_size)
    assert cache.insert(tokens, pages) == 0
    return pages


def test_empty_cache_matches_nothing_at_root() -> None:
    _, cache = make_cache()
    match = cache.match_prefix([1, 2, 3, 4])
    assert (match.page_ids, match.num_tokens, match.node) == ([], 0, cache.root)
    assert cache.match_prefix([]).num_tokens == 0


def test_match_of_inserted_sequence_returns_its_pages() -> None:
    pool, cache = make_cache()
    pages = cache_tokens(cache, pool, [1, 2, 3, 4, 5, 6])
    match = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert match.page_ids == pages and match.num_tokens == 6
    assert match.node.pages == pages and match.node.parent is cache.root
    assert cache.num_cached_pages == cache.num_evictable_pages == 3
    assert pool.num_free == 13
    # A different first page misses entirely.
    assert cache.match_prefix([1, 3, 3, 4]).num_tokens == 0


def test_partial_page_tail_is_ignored() -> None:
    pool, cache = make_cache()
    pages = cache_tokens(cache, pool, [1, 2, 3, 4])
    match = cache.match_prefix([1, 2, 3, 4, 5])  # 5 is a partial page
    assert match.page_ids == pages and match.num_tokens == 4
    assert cache.match_prefix([1, 2, 3]).page_ids == pages[:1]
    # A partial page that agrees with the cached tokens still does not count.
    assert cache.match_prefix([1]).num_tokens == 0


def test_match_ending_mid_edge_splits_at_the_page() -> None:
    pool, cache = make_cache()
    pages = cache_tokens(cache, pool, [1, 2, 3, 4, 5, 6])
    match = cache.match_prefix([1, 2, 3, 4, 0, 0])
    assert match.page_ids == pages[:2] and match.num_tokens == 4
    upper = match.node
    assert upper.tokens == (1, 2, 3, 4) and upper.pages == pages[:2]
    (lower,) = upper.children.values()
    assert lower.tokens == (5, 6) and lower.pages == pages[2:] and lower.parent is upper
    assert cache.num_cached_pages == 3
    # Both halves still match together.
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).page_ids == pages


def test_insert_of_cached_prefix_keeps_tree_pages_and_takes_only_new_ones() -> None:
    pool, cache = make_cache()
    first = cache_tokens(cache, pool, [1, 2, 3, 4, 5, 6])
    second = pool.allocate(3)
    assert cache.insert([1, 2, 3, 4, 0, 0], second) == 4
    pool.free(second[:2])  # the caller's duplicates of first[:2]
    assert cache.match_prefix([1, 2, 3, 4, 0, 0]).page_ids == first[:2] + second[2:]
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).page_ids == first
    assert cache.num_cached_pages == 4 and pool.num_free == 12
    # Inserting something fully cached takes nothing.
    again = pool.allocate(2)
    assert cache.insert([1, 2, 3, 4], again) == 4
    assert cache.num_cached_pages == 4


def test_insert_rejects_tokens_that_do_not_fill_the_pages() -> None:
    _, cache = make_cache()
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3], [0, 1])


def test_lock_prevents_eviction_and_unlock_restores_it() -> None:
    pool, cache = make_cache()
    cache_tokens(cache, pool, [1, 2, 3, 4])
    cache_tokens(cache, pool, [5, 6])
    match = cache.match_prefix([1, 2, 3, 4])
    cache.lock(match.node)
    assert cache.num_evictable_pages == 1
    assert cache.evict(10) == 1  # only the unlocked (5, 6)
    assert cache.match_prefix([1, 2, 3, 4]).page_ids == match.page_ids
    with pytest.raises(RuntimeError):
        cache.reset()
    cache.unlock(match.node)
    assert cache.num_evictable_pages == 2
    assert cache.evict(10) == 2 and pool.num_free == 16 and cache.num_cached_pages == 0


def test_lock_survives_a_split_of_the_locked_edge() -> None:
    pool, cache = make_cache()
    cache_tokens(cache, pool, [1, 2, 3, 4, 5, 6])
    node = cache.match_prefix([1, 2, 3, 4, 5, 6]).node
    cache.lock(node)
    upper = cache.match_prefix([1, 2]).node  # splits the locked edge
    assert upper.lock_ref == node.lock_ref == 1 and cache.num_evictable_pages == 0
    cache.unlock(node)
    assert upper.lock_ref == 0 and cache.num_evictable_pages == 3


def test_unlock_below_zero_raises() -> None:
    pool, cache = make_cache()
    cache_tokens(cache, pool, [1, 2])
    node = cache.match_prefix([1, 2]).node
    with pytest.raises(ValueError):
        cache.unlock(node)
    cache.lock(node)
    cache.unlock(node)
    with pytest.raises(ValueError):
        cache.unlock(node)
    cache.lock(cache.root)  # the root is never counted: a no-op both ways
    cache.unlock(cache.root)
    cache.unlock(cache.root)


def test_lru_evicts_the_least_recently_matched_leaf_first() -> None:
    pool, cache = make_cache()
    a = cache_tokens(cache, pool, [1, 1])
    b = cache_tokens(cache, pool, [2, 2])
    c = cache_tokens(cache, pool, [3, 3])
    cache.match_prefix([1, 1])  # now b is the oldest, then c, then a
    assert cache.evict(1) == 1
    assert pool.allocate(1) == b  # LIFO pool: the page just freed comes back first
    assert cache.match_prefix([2, 2]).num_tokens == 0
    assert cache.evict(1) == 1 and cache.match_prefix([3, 3]).num_tokens == 0
    assert cache.match_prefix([1, 1]).page_ids == a
    assert c[0] not in cache.match_prefix([1, 1]).page_ids


def test_evicting_a_leaf_then_its_parent() -> None:
    pool, cache = make_cache()
    base = cache_tokens(cache, pool, [1, 2, 3, 4])
    tail = pool.allocate(1)
    assert cache.insert([1, 2, 3, 4, 5, 6], base + tail) == 4
    cache_tokens(cache, pool, [7, 7])  # the newest; the (1 2 3 4)->(5 6) path is older
    assert cache.evict(1) == 1
    # Matching refreshes the LRU clock, so re-touch (7, 7) after each look at the other path.
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).page_ids == base
    cache.match_prefix([7, 7])
    # The parent became a leaf: one page trims its tail, the next removes it.
    assert cache.evict(1) == 1
    assert cache.match_prefix([1, 2, 3, 4]).page_ids == base[:1]
    cache.match_prefix([7, 7])
    assert cache.evict(1) == 1 and cache.match_prefix([1, 2]).num_tokens == 0
    assert cache.num_cached_pages == 1 and cache.match_prefix([7, 7]).num_tokens == 2
    assert cache.evict(5) == 1 and pool.num_free == 16


def test_reset_frees_everything_unlocked() -> None:
    pool, cache = make_cache()
    cache_tokens(cache, pool, [1, 2, 3, 4])
    pages = pool.allocate(2)
    assert cache.insert([1, 2, 5, 5], pages) == 2
    pool.free(pages[:1])
    cache.reset()
    assert pool.num_free == 16 and cache.num_cached_pages == cache.num_evictable_pages == 0
    assert not cache.root.children


def test_evicted_node_cannot_be_locked() -> None:
    pool, cache = make_cache()
    cache_tokens(cache, pool, [1, 2])
    node = cache.match_prefix([1, 2]).node
    cache.evict(1)
    with pytest.raises(ValueError):
        cache.lock(node)


def test_disabled_cache_matches_nothing_and_takes_nothing() -> None:
    pool, cache = make_cache(enabled=False)
    pages = pool.allocate(2)
    assert cache.insert([1, 2, 3, 4], pages) == 0
    match = cache.match_prefix([1, 2, 3, 4])
    assert (match.page_ids, match.num_tokens, match.node) == ([], 0, cache.root)
    cache.lock(match.node)
    cache.unlock(match.node)
    assert cache.num_cached_pages == 0 and cache.evict(4) == 0
    pool.free(pages)
    assert pool.num_free == 16


# ---------------------------------------------------------------------------------------------
# Stateful: the scheduler's use of the cache, checked against its invariants after every step.


@dataclass(slots=True)
class LiveRequest:
    tokens: list[int]  # prompt + generated tokens, all of whose K/V get computed
    node: TreeNode  # locked while the request lives
    pages: list[int]  # page table: [ shared (tree's) | own (private) ]
    num_shared: int


NUM_PAGES = 24
# Prompts are a cut of one of a few shared "documents" plus a random tail, so that requests share
# prefixes of every length (whole leaves, mid-edge cuts) far more often than random ids would.
DOCUMENTS = ([0] * 16, [0, 1] * 8, [0, 1, 2, 2] * 4, [2, 1, 0] * 5 + [0])
tokens_st = st.builds(
    lambda doc, cut, tail: doc[:cut] + tail,
    st.sampled_from(DOCUMENTS),
    st.integers(0, 16),
    st.lists(st.integers(0, 2), max_size=6),
)


class RadixCacheMachine(RuleBasedStateMachine):
    requests = Bundle("requests")

    @initialize(page_size=st.sampled_from([2, 4]))
    def setup(self, page_size: int) -> None:
        self.pool = PagePool(NUM_PAGES, page_size)
        self.cache = RadixCache(self.pool)
        self.live: list[LiveRequest] = []

    @rule(target=requests, prompt=tokens_st, output=st.lists(st.integers(0, 2), max_size=6))
    def start_request(self, prompt: list[int], output: list[int]) -> object:
        tokens = prompt + output
        match = self.cache.match_prefix(prompt)
        assert match.num_tokens == len(match.page_ids) * self.pool.page_size
        assert tuple(prompt[: match.num_tokens]) == self._path_tokens(match.node)
        self.cache.lock(match.node)
        need = self.pool.pages_for(len(tokens)) - len(match.page_ids)
        if need > self.pool.num_free + self.cache.num_evictable_pages:
            self.cache.unlock(match.node)
            return multiple()  # the request waits: no pages, nothing added to the bundle
        shortfall = need - self.pool.num_free
        if shortfall > 0:
            assert self.cache.evict(shortfall) == shortfall
        request = LiveRequest(
            tokens, match.node, match.page_ids + self.pool.allocate(need), len(match.page_ids)
        )
        self.live.append(request)
        return request

    @rule(request=consumes(requests))
    def finish_request(self, request: LiveRequest) -> None:
        size = self.pool.page_size
        num_full = len(request.tokens) // size
        already = self.cache.insert(request.tokens[: num_full * size], request.pages[:num_full])
        assert already % size == 0 and already // size >= request.num_shared
        # The tree holds its old pages for the cached part and exactly ours for the rest.
        prefixes = self._prefix_pages()
        for i in [*range(request.num_shared), *range(already // size, num_full)]:
            assert prefixes[tuple(request.tokens[: (i + 1) * size])] == request.pages[i]
        # Own pages the tree already had a copy of go back, as does the partial last page.
        self.pool.free(request.pages[request.num_shared : already // size])
        self.pool.free(request.pages[num_full:])
        self.cache.unlock(request.node)
        self.live.remove(request)

    @rule(request=consumes(requests))
    def abort_request(self, request: LiveRequest) -> None:
        self.pool.free(request.pages[request.num_shared :])
        self.cache.unlock(request.node)
        self.live.remove(request)

    @rule(num_pages=st.integers(0, NUM_PAGES))
    def evict(self, num_pages: int) -> None:
        evictable = self.cache.num_evictable_pages
        assert self.cache.evict(num_pages) == min(num_pages, evictable)

    @rule(tokens=tokens_st)
    def match_only(self, tokens: list[int]) -> None:
        match = self.cache.match_prefix(tokens)
        prefixes = self._prefix_pages()
        size = self.pool.page_size
        for i, page in enumerate(match.page_ids):
            assert prefixes[tuple(tokens[: (i + 1) * size])] == page
        longer = tokens[: match.num_tokens + size]
        assert len(longer) < match.num_tokens + size or tuple(longer) not in prefixes

    @invariant()
    def pages_are_conserved_and_owned_once(self) -> None:
        tree_pages = [page for node in self._nodes() for page in node.pages]
        own_pages = [page for r in self.live for page in r.pages[r.num_shared :]]
        free_pages = list(self.pool._free)
        everything = tree_pages + own_pages + free_pages
        assert len(everything) == len(set(everything)) == NUM_PAGES
        assert self.cache.num_cached_pages == len(tree_pages)
        # Live requests read their shared pages from the tree: locked, so still there, same ids.
        prefixes = self._prefix_pages()
        size = self.pool.page_size
        for r in self.live:
            for i in range(r.num_shared):
                assert prefixes[tuple(r.tokens[: (i + 1) * size])] == r.pages[i]

    @invariant()
    def lock_counts_and_counters_match_the_live_requests(self) -> None:
        expected: dict[TreeNode, int] = {}
        for r in self.live:
            node: TreeNode | None = r.node
            while node is not None and node is not self.cache.root:
                expected[node] = expected.get(node, 0) + 1
                node = node.parent
        evictable = 0
        for node in self._nodes():
            assert node.lock_ref == expected.get(node, 0)
            evictable += len(node.pages) if node.lock_ref == 0 else 0
        assert self.cache.num_evictable_pages == evictable

    def _nodes(self) -> list[TreeNode]:
        """Every node but the root, checking the tree's shape on the way."""
        size = self.pool.page_size
        nodes: list[TreeNode] = []
        stack = [self.cache.root]
        while stack:
            node = stack.pop()
            for key, child in node.children.items():
                assert child.parent is node and key == child.tokens[:size]
                assert child.pages and len(child.tokens) == len(child.pages) * size
                # A touch stamps a whole path, so no node is fresher than its parent.
                assert node is self.cache.root or node.last_access >= child.last_access
                nodes.append(child)
                stack.append(child)
        return nodes

    def _prefix_pages(self) -> dict[tuple[int, ...], int]:
        """Each cached page by the full token prefix it ends: a flat model of the tree."""
        size = self.pool.page_size
        result: dict[tuple[int, ...], int] = {}
        for node in self._nodes():
            prefix = self._path_tokens(node)
            start = len(prefix) - len(node.tokens)
            for i, page in enumerate(node.pages):
                result[prefix[: start + (i + 1) * size]] = page
        return result

    def _path_tokens(self, node: TreeNode) -> tuple[int, ...]:
        parts: list[tuple[int, ...]] = []
        current: TreeNode | None = node
        while current is not None:
            parts.append(current.tokens)
            current = current.parent
        return tuple(t for part in reversed(parts) for t in part)


RadixCacheMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=50, deadline=None
)
test_radix_cache_as_the_scheduler_uses_it = RadixCacheMachine.TestCase
