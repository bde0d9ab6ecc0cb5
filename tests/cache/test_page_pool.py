from __future__ import annotations

import pytest

from yaied.cache.page_pool import OutOfPagesError, PagePool


def test_allocate_free_and_double_free():
    pool = PagePool(4, 16)
    pages = pool.allocate(3)
    assert len(set(pages)) == 3 and pool.num_free == 1
    with pytest.raises(OutOfPagesError):
        pool.allocate(2)
    pool.free(pages[:1])
    with pytest.raises(ValueError, match="freed twice"):
        pool.free(pages[:1])
    pool.free(pages[1:])
    assert pool.num_free == 4


def test_pages_for_rounds_up():
    pool = PagePool(2, 16)
    assert [pool.pages_for(n) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]
