r"""The radix prefix cache ("RadixAttention"): requests that share a prefix share its KV pages.

A radix tree over token ids whose edges hold whole pages only: a partial page is never shared,
since the request that owns it still writes K/V into it. Each edge carries its tokens and the
ids of the pages holding their K/V, ``pages[i]`` for ``tokens[i*page_size:(i+1)*page_size]``.
Children are keyed by the first page of their edge: two siblings never share a first page (that
page would have been split off into their common parent), so it picks the branch.

After ``insert([1,2, 3,4, 5,6], [7,8,9])`` then ``insert([1,2, 3,4, 9,9], [10,11,12])`` with
page_size 2, the second insert returns 4 (two pages already cached) and splits the first edge at
that page boundary; the caller keeps (and frees) its duplicates 10 and 11, the tree takes 12:

        root                               root
         |                                  |
    (1,2 3,4 5,6)                       (1,2 3,4)    pages [7, 8]
    pages [7, 8, 9]        ->            /      \
                                     (5,6)      (9,9)
                                  pages [9]   pages [12]

Users lock the node where their match ends while they read its pages: a lock counts on every
node from there up to the root, so a node's ``lock_ref`` is the number of users at or below it
and a locked node's ancestors are locked too. Eviction frees the least recently used unlocked
leaves, tail first, so whatever stays cached is still a prefix path from the root.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from yaied.cache.page_pool import PagePool


@dataclass(slots=True, eq=False)
class TreeNode:
    """An edge of the tree and the node it ends at (compared by identity).

    ``len(tokens) == len(pages) * page_size`` always; only the root has no pages. A node that was
    evicted is detached (``parent`` None) and must not be locked again.
    """

    tokens: tuple[int, ...]
    pages: list[int]
    # Out of the repr: a node would otherwise print the whole tree, through its parent.
    parent: TreeNode | None = field(repr=False)
    children: dict[tuple[int, ...], TreeNode] = field(default_factory=dict, repr=False)
    lock_ref: int = 0  # users whose locked node is this one or below it
    last_access: int = 0  # the cache's clock at the last match or insert through this node


@dataclass(slots=True)
class PrefixMatch:
    page_ids: list[int]  # the cached pages covering the matched prefix, in order (a copy)
    num_tokens: int  # matched tokens == len(page_ids) * page_size
    node: TreeNode  # where the match ends (the root when nothing matched); lock it while in use


class RadixCache:
    def __init__(self, pool: PagePool, *, enabled: bool = True) -> None:
        self.pool = pool
        self.page_size = pool.page_size
        self.enabled = enabled
        self.root = TreeNode(tokens=(), pages=[], parent=None)
        # A logical clock, not wall time, so LRU order is deterministic under test.
        self._clock = 0
        self._num_cached_pages = 0
        self._num_evictable_pages = 0  # pages in nodes with lock_ref == 0

    @property
    def num_cached_pages(self) -> int:
        """Pages the tree owns."""
        return self._num_cached_pages

    @property
    def num_evictable_pages(self) -> int:
        """Pages in unlocked nodes. All of them can be evicted: an unlocked node has no locked
        descendant, so eviction reaches it once its subtree is gone."""
        return self._num_evictable_pages

    def match_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        """The longest cached prefix of ``token_ids`` in whole pages (a trailing partial page is
        ignored). Splits an edge where the match ends inside it, so the returned node ends exactly
        at the match, and refreshes the matched path for LRU."""
        if not self.enabled:
            return PrefixMatch(page_ids=[], num_tokens=0, node=self.root)
        whole = len(token_ids) // self.page_size * self.page_size
        node, num_tokens, page_ids = self._descend(tuple(token_ids[:whole]))
        self._touch(node)
        return PrefixMatch(page_ids=page_ids, num_tokens=num_tokens, node=node)

    def insert(self, token_ids: Sequence[int], page_ids: Sequence[int]) -> int:
        """Cache ``token_ids`` (whole pages) whose K/V sit in ``page_ids``. Returns how many
        leading tokens were already cached: for those the tree keeps its own pages and the caller
        keeps ``page_ids[:returned // page_size]``; the tree takes the caller's other pages.

            token_ids: [ already cached (tree's pages) | new (caller's pages, now the tree's) ]
                         0 .. returned                   returned .. len(token_ids)
        """
        if len(token_ids) != len(page_ids) * self.page_size:
            raise ValueError(
                f"{len(token_ids)} tokens do not fill {len(page_ids)} pages "
                f"of {self.page_size} tokens exactly"
            )
        if not self.enabled:
            return 0
        tokens = tuple(token_ids)
        node, num_cached, _ = self._descend(tokens)
        if num_cached < len(tokens):
            leaf = TreeNode(
                tokens=tokens[num_cached:],
                pages=list(page_ids[num_cached // self.page_size :]),
                parent=node,
            )
            node.children[leaf.tokens[: self.page_size]] = leaf
            self._num_cached_pages += len(leaf.pages)
            self._num_evictable_pages += len(leaf.pages)
            node = leaf
        self._touch(node)
        return num_cached

    def lock(self, node: TreeNode) -> None:
        """Pin ``node`` and its ancestors: none of them is evicted until the matching unlock."""
        self._check_attached(node)
        for n in self._path(node):
            if n.lock_ref == 0:
                self._num_evictable_pages -= len(n.pages)
            n.lock_ref += 1

    def unlock(self, node: TreeNode) -> None:
        self._check_attached(node)
        # Ancestors count at least the locks of their descendants, so checking node is enough.
        if node is not self.root and node.lock_ref <= 0:
            raise ValueError("unlock without a matching lock")
        for n in self._path(node):
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._num_evictable_pages += len(n.pages)

    def evict(self, num_pages: int) -> int:
        """Free up to ``num_pages`` pages, least recently used unlocked leaves first. Frees exactly
        ``min(num_pages, num_evictable_pages)``: the last leaf taken may lose only its tail pages.
        Returns the number freed."""
        if num_pages <= 0:
            return 0
        # Ties on last_access (one touch stamps a whole path) break in traversal order; the
        # counter also keeps the heap from ever comparing two nodes.
        order = itertools.count()
        heap = [(leaf.last_access, next(order), leaf) for leaf in self._evictable_leaves()]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_pages:
            _, _, leaf = heapq.heappop(heap)
            take = min(len(leaf.pages), num_pages - freed)
            parent = self._free_tail(leaf, take)
            freed += take
            # Its parent may have just become an unlocked leaf: a candidate in its own right.
            if parent is not None and self._is_evictable_leaf(parent):
                heapq.heappush(heap, (parent.last_access, next(order), parent))
        return freed

    def reset(self) -> None:
        """Free every cached page. Raises if any node is locked (a user still reads its pages)."""
        if any(child.lock_ref > 0 for child in self.root.children.values()):
            raise RuntimeError("cannot reset the radix cache while nodes are locked")
        self.evict(self._num_cached_pages)
        assert not self.root.children and self._num_cached_pages == 0

    def _descend(self, tokens: tuple[int, ...]) -> tuple[TreeNode, int, list[int]]:
        """Walk down along ``tokens`` (whole pages): the node where the cached prefix ends, its
        length in tokens and its pages. An edge the prefix ends inside is split at that page."""
        size = self.page_size
        node, pos, page_ids = self.root, 0, []
        while pos < len(tokens):
            child = node.children.get(tokens[pos : pos + size])
            if child is None:
                break
            n = self._matching_pages(child, tokens, pos)
            if n < len(child.pages):
                child = self._split(child, n)
            page_ids.extend(child.pages)
            pos += n * size
            node = child
            # After a split the only child of `node` starts with a page that did not match (or
            # tokens ran out), so the next lookup ends the walk.
        return node, pos, page_ids

    def _matching_pages(self, child: TreeNode, tokens: tuple[int, ...], pos: int) -> int:
        """Whole pages of ``child``'s edge that equal ``tokens`` from ``pos`` (at least 1: the
        first page matched as the child's key)."""
        size = self.page_size
        limit = min(len(child.pages), (len(tokens) - pos) // size)
        n = 1
        while n < limit:
            lo = n * size
            if child.tokens[lo : lo + size] != tokens[pos + lo : pos + lo + size]:
                break
            n += 1
        return n

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Split ``child``'s edge after its first ``n`` pages; returns the new upper node.

            before:  parent --[p0 .. p(n-1) | pn ..]--> child
            after:   parent --[p0 .. p(n-1)]--> upper --[pn ..]--> child

        Each page keeps exactly one owner. ``upper`` inherits ``child``'s lock_ref (every user at
        or below upper is at or below child) and last_access, so both counters stay unchanged.
        """
        size = self.page_size
        parent = child.parent
        assert parent is not None and 0 < n < len(child.pages)
        upper = TreeNode(
            tokens=child.tokens[: n * size],
            pages=child.pages[:n],
            parent=parent,
            lock_ref=child.lock_ref,
            last_access=child.last_access,
        )
        child.tokens = child.tokens[n * size :]
        child.pages = child.pages[n:]
        child.parent = upper
        upper.children[child.tokens[:size]] = child
        parent.children[upper.tokens[:size]] = upper
        return upper

    def _free_tail(self, leaf: TreeNode, n: int) -> TreeNode | None:
        """Give the last ``n`` pages of an unlocked leaf back to the pool; a leaf left without
        pages is detached. Returns its former parent when detached, else None."""
        size = self.page_size
        keep = len(leaf.pages) - n
        key = leaf.tokens[:size]
        self.pool.free(leaf.pages[keep:])
        leaf.pages = leaf.pages[:keep]
        leaf.tokens = leaf.tokens[: keep * size]
        self._num_cached_pages -= n
        self._num_evictable_pages -= n
        if keep > 0:
            return None
        parent = leaf.parent
        assert parent is not None
        del parent.children[key]
        leaf.parent = None
        return parent

    def _evictable_leaves(self) -> Iterator[TreeNode]:
        # Iterative: a long, much-branched prompt history can be deeper than Python's stack.
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if self._is_evictable_leaf(node):
                yield node

    def _is_evictable_leaf(self, node: TreeNode) -> bool:
        return node is not self.root and not node.children and node.lock_ref == 0

    def _touch(self, node: TreeNode) -> None:
        self._clock += 1
        for n in self._path(node):
            n.last_access = self._clock

    def _path(self, node: TreeNode) -> Iterator[TreeNode]:
        """``node`` and its ancestors, the root excluded."""
        current: TreeNode | None = node
        while current is not None and current is not self.root:
            yield current
            current = current.parent

    def _check_attached(self, node: TreeNode) -> None:
        if node is not self.root and node.parent is None:
            raise ValueError("node was evicted from the radix cache")
