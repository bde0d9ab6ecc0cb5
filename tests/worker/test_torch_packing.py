"""Step inputs on the torch path: a few plain decodes, built in Python, give what the general
tensor path gives for each request (rows may be in another order: the general path sorts decodes
by context length)."""

from __future__ import annotations

import random

import pytest
import torch

from yaied.core.request import SamplingParams
from yaied.core.step import ScheduledSeq
from yaied.kernels.cpu_decode import CpuDecodeKernel
from yaied.worker import torch_packing
from yaied.worker.torch_packing import TorchBatchPacker

kernel = CpuDecodeKernel.load()
pytestmark = pytest.mark.skipif(kernel is None, reason="no C compiler for the decode kernel")


def decodes(count: int, page_size: int, seed: int) -> list[ScheduledSeq]:
    rng = random.Random(seed)
    pages = list(range(1, 400))
    rng.shuffle(pages)
    seqs = []
    for i in range(count):
        position = rng.randrange(0, 120)
        owned = [pages.pop() for _ in range(position // page_size + 1 + rng.randrange(2))]
        seqs.append(
            ScheduledSeq(
                f"r{i}", [rng.randrange(1000)], position, owned, i % 3 != 1, SamplingParams()
            )
        )
    return seqs


@pytest.mark.parametrize("count", [1, 2, 5, 8])
def test_few_decodes_match_the_general_path(count, monkeypatch):
    builder = TorchBatchPacker(16, torch.device("cpu"), torch.bfloat16, 2, kernel, None)
    seqs = decodes(count, 16, seed=count)
    fast = builder.build(seqs)
    monkeypatch.setattr(torch_packing, "FEW_DECODES", 0)
    general = builder.build(seqs)
    assert fast.meta.kernel_decodes.step is not None and general.meta.kernel_decodes is not None

    def per_request(prepared) -> dict[str, tuple]:
        meta, decodes_ = prepared.meta, prepared.meta.kernel_decodes
        out = {}
        for request_id, row in prepared.first_row.items():
            table = decodes_.page_table[row]
            used = int(torch.count_nonzero(table))  # page ids are never 0 here
            out[request_id] = (
                int(prepared.input_ids[row]),
                int(prepared.positions[row]),
                int(meta.slot_mapping[row]),
                int(decodes_.context_lens[row]),
                table[:used].tolist(),
            )
        return out

    assert per_request(fast) == per_request(general)
    order = {row: rid for rid, row in fast.first_row.items()}
    general_order = {row: rid for rid, row in general.first_row.items()}
    assert [order[int(r)] for r in fast.sample_rows] == [
        general_order[int(r)] for r in general.sample_rows
    ]  # sampled requests in batch order either way
    assert fast.meta.prefills == general.meta.prefills == []
