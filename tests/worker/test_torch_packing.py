"""Step inputs on the torch path: a few plain decodes, built in Python, give what the general
tensor path gives for each request (rows may be in another order: the general path sorts decodes
by context length); short prompt chunks share one prefill kernel call, with each chunk's bits."""

from __future__ import annotations

import random

import pytest
import torch

from yaied.core.request import SamplingParams
from yaied.core.step import ScheduledSeq
from yaied.kernels.cpu_decode import CpuDecodeKernel
from yaied.kernels.cpu_prefill import CpuPrefillKernel
from yaied.worker import torch_packing
from yaied.worker.attention import paged_attention
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


def prompt_chunks(lengths_and_starts, page_size: int, seed: int) -> list[ScheduledSeq]:
    rng = random.Random(seed)
    pages = list(range(1, 200))
    rng.shuffle(pages)
    seqs = []
    for i, (n, start) in enumerate(lengths_and_starts):
        owned = [pages.pop() for _ in range(-(-(start + n) // page_size))]
        tokens = [rng.randrange(1000) for _ in range(n)]
        seqs.append(ScheduledSeq(f"p{i}", tokens, start, owned, True, SamplingParams()))
    return seqs


def test_short_chunks_share_one_prefill_call_with_the_same_bits():
    prefill = CpuPrefillKernel.load()
    if prefill is None:
        pytest.skip("no C compiler for the prefill kernel")
    kv_heads, group, dim, page_size = 2, 3, 64, 16
    packer = TorchBatchPacker(
        page_size, torch.device("cpu"), torch.bfloat16, kv_heads, None, prefill,
        attention_shape=(kv_heads * group, dim),
    )  # fmt: skip
    # one chunk worth a fork-join, five short ones (two over cached context)
    seqs = prompt_chunks([(300, 0), (7, 0), (13, 0), (2, 40), (5, 90), (30, 0)], page_size, 3)
    packed = packer.build(seqs)
    batched, _ = packed.meta.batched_chunks
    assert [c.num_tokens for c in packed.meta.prefills] == [300]
    assert sorted(batched[:, 1].tolist()) == [2, 5, 7, 13, 30]
    # the paths that take a chunk at a time see every chunk, with its own pages
    by_row = {c.start: c for c in packed.meta.every_prefill(page_size)}
    for seq in seqs:
        chunk = by_row[packed.first_row[seq.request_id]]
        assert (chunk.num_tokens, chunk.start_pos) == (len(seq.token_ids), seq.start_pos)
        assert chunk.pages.tolist() == seq.page_ids
    torch.manual_seed(0)
    k_cache = torch.randn(kv_heads, 200, page_size, dim).bfloat16()
    v_cache = torch.randn_like(k_cache)
    rows = len(packed.input_ids)
    q = torch.randn(rows, kv_heads * group, dim).bfloat16()
    kv = torch.zeros(rows, kv_heads, dim, dtype=torch.bfloat16)  # already in the pool
    out = paged_attention(q, kv, kv, k_cache, v_cache, packed.meta, 0.125)
    for seq in seqs:  # each chunk alone, in its own call
        first, n = packed.first_row[seq.request_id], len(seq.token_ids)
        alone = prefill(
            q[first : first + n], k_cache, v_cache, torch.tensor(seq.page_ids), seq.start_pos,
            0.125,
        )  # fmt: skip
        assert torch.equal(out[first : first + n], alone), seq.request_id


def test_a_chunk_worth_a_fork_join_gets_its_own_call():
    prefill = CpuPrefillKernel.load()
    if prefill is None:
        pytest.skip("no C compiler for the prefill kernel")
    packer = TorchBatchPacker(
        16, torch.device("cpu"), torch.bfloat16, 2, None, prefill, attention_shape=(6, 64)
    )
    assert not prefill.runs_alone(64, 0, 6, 64) and prefill.runs_alone(8, 0, 6, 64)
    packed = packer.build(prompt_chunks([(64, 0), (8, 0)], 16, 1))
    assert [c.num_tokens for c in packed.meta.prefills] == [64]
    assert packed.meta.batched_chunks[0][:, 1].tolist() == [8]
