"""KV page bookkeeping for requests: the page pool plus the radix prefix cache, in one place.

A request's page table is split in two:

    page_ids:  [ shared (the cache's, locked) | own (allocated for this request)            ]
                 0 .. num_shared_pages          num_shared_pages .. len(page_ids)
    tokens:    [ matched prefix               | computed since   | not yet computed ]
                 0 .. num_shared_pages*size     .. num_computed_tokens .. num_tokens

Caching a request (finished, preempted, or between prefill chunks) inserts its computed full pages
into the tree. For the part the tree already held, the request's own duplicate pages are freed;
for the rest, the tree takes the request's pages. A finished request then frees what is left (the
partial last page) and unlocks; an unfinished one swaps its page table over to the tree's pages
and locks the new, longer prefix. Pure Python over ints: tested without a model.
"""

from __future__ import annotations

from yaied.cache.page_pool import PagePool
from yaied.cache.radix_cache import RadixCache
from yaied.core.request import Request


class KVCacheManager:
    def __init__(self, pool: PagePool, *, enable_prefix_caching: bool = True) -> None:
        self.pool = pool
        self.page_size = pool.page_size
        self.enabled = enable_prefix_caching
        self.tree = RadixCache(pool, enabled=enable_prefix_caching)
        self.num_queried_tokens = 0  # prompt tokens looked up in the prefix cache
        self.num_hit_tokens = 0  # of those, tokens found cached

    @property
    def num_free_pages(self) -> int:
        """Pages a request could get now: free ones plus cached ones nobody is using."""
        return self.pool.num_free + self.tree.num_evictable_pages

    def match_prefix(self, request: Request, *, lookup: bool = True) -> None:
        """Point a request without pages at the longest cached prefix of its tokens. At least one
        token is left to compute, since its logits give the next token. Without lookup (a
        request that must compute every position, for prompt logprobs) the match is empty: the
        request still gets the root as its prefix node, so caching its pages later swaps one
        locked node for another like any other request's."""
        assert not request.page_ids and request.num_computed_tokens == 0
        tokens = request.all_token_ids[: request.num_tokens - 1] if lookup else []
        match = self.tree.match_prefix(tokens)
        self.tree.lock(match.node)
        request.prefix_node = match.node
        request.page_ids = list(match.page_ids)
        request.num_shared_pages = len(match.page_ids)
        request.num_computed_tokens = match.num_tokens
        request.num_cached_tokens = min(match.num_tokens, request.num_prompt_tokens)

    def count_prefix_hit(self, request: Request) -> None:
        """Count a request's prompt in the hit-rate totals, once, when it is first admitted."""
        if not request.prefix_counted:
            request.prefix_counted = True
            self.num_queried_tokens += request.num_prompt_tokens
            self.num_hit_tokens += request.num_cached_tokens

    def reserve(self, request: Request, num_tokens: int) -> bool:
        """Give the request pages for its next num_tokens tokens, evicting unused cached pages
        if needed. False (and nothing changed) when even that is not enough."""
        need = self.pool.pages_for(request.num_computed_tokens + num_tokens) - len(request.page_ids)
        if need <= 0:
            return True
        if need > self.num_free_pages:
            return False
        if need > self.pool.num_free:
            self.tree.evict(need - self.pool.num_free)
        request.page_ids.extend(self.pool.allocate(need))
        return True

    def trim(self, request: Request) -> None:
        """Free the request's pages past its tokens: the slots of rejected draft tokens
        (speculative decoding). Those pages are the request's own, never the tree's."""
        keep = max(self.pool.pages_for(request.num_tokens), request.num_shared_pages)
        if len(request.page_ids) > keep:
            self.pool.free(request.page_ids[keep:])
            del request.page_ids[keep:]

    def cache(self, request: Request) -> None:
        """Move a running request's computed full pages into the tree and share them from there."""
        num_full = request.num_computed_tokens // self.page_size
        if num_full <= request.num_shared_pages:
            return
        match = self._insert(request, num_full)
        if match is None:
            return
        self.tree.lock(match.node)
        self.tree.unlock(request.prefix_node)
        request.prefix_node = match.node
        request.page_ids[:num_full] = match.page_ids
        request.num_shared_pages = num_full

    def release(self, request: Request, *, keep: bool) -> None:
        """Give back every page of a request that stops running (finished or preempted). With
        keep, its computed pages stay cached for later hits (a preempted request resumes from
        them); without, they are freed (e.g. after a failed step, whose K/V may be incomplete)."""
        num_full = request.num_computed_tokens // self.page_size if keep else 0
        owned_from = request.num_shared_pages
        if num_full > request.num_shared_pages and self._insert(request, num_full) is not None:
            owned_from = num_full
        self.pool.free(request.page_ids[owned_from:])
        if request.prefix_node is not None:
            self.tree.unlock(request.prefix_node)
        request.prefix_node = None
        request.page_ids = []
        request.num_shared_pages = 0

    def _insert(self, request: Request, num_full: int):
        """Insert pages [0, num_full); free the request's own duplicates of pages the tree already
        had. Returns the tree's match for the inserted tokens, or None with the cache disabled."""
        tokens = request.all_token_ids[: num_full * self.page_size]
        already = self.tree.insert(tokens, request.page_ids[:num_full]) // self.page_size
        if not self.enabled:
            return None
        duplicates = request.page_ids[request.num_shared_pages : already]
        self.pool.free(duplicates)
        match = self.tree.match_prefix(tokens)
        assert match.num_tokens == len(tokens), "inserted pages must match back in full"
        # The tree now owns pages [0, num_full) of this request: the old shared ones, the ones it
        # already had (replacing the freed duplicates) and the ones just handed over.
        request.page_ids[:num_full] = match.page_ids
        request.num_shared_pages = num_full
        return match
