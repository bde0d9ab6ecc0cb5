"""The page pool: which KV pages are free. Pure Python over ints, tested in milliseconds."""

from __future__ import annotations


class OutOfPagesError(RuntimeError):
    pass


class PagePool:
    """A free list of page ids ``0 .. num_pages - 1``.

    Pages are handed out in LIFO order (the most recently freed first), which keeps the working set
    of the KV tensors small and warm in cache.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError("a page pool needs at least one page of at least one token")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._is_free = [True] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.page_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPagesError(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for page in pages:
            self._is_free[page] = False
        return pages

    def free(self, pages: list[int]) -> None:
        for page in pages:
            if self._is_free[page]:
                raise ValueError(f"page {page} freed twice")
            self._is_free[page] = True
            self._free.append(page)
