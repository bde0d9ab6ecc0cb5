"""Decode graph buckets on CPU; capture and replay (greedy parity) on CUDA."""

from __future__ import annotations

import pytest

from yaied.worker.cuda_graphs import MAX_GRAPH_BATCH, graph_batch_sizes, padded_batch_size


def test_bucket_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(6) == [1, 2, 4, 6]
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert graph_batch_sizes(30) == [1, 2, 4, 8, 16, 24, 30]
    assert graph_batch_sizes(10_000)[-1] == MAX_GRAPH_BATCH
    with pytest.raises(ValueError):
        graph_batch_sizes(0)


def test_padding_picks_the_smallest_bucket_that_holds_the_batch():
    sizes = graph_batch_sizes(64)
    assert [padded_batch_size(sizes, n) for n in (1, 3, 5, 8, 9, 63, 64)] == [
        1, 4, 8, 8, 16, 64, 64,
    ]  # fmt: skip
    assert padded_batch_size(sizes, 65) is None
    for n in range(1, 65):  # never more than 7 padding rows past 8
        assert padded_batch_size(sizes, n) - n <= (7 if n > 8 else 4)
