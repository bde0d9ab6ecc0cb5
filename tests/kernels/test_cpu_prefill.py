"""The CPU paged prefill kernel against the torch reference path: odd lengths, page boundaries,
GQA, extend chunks over cached context, fp32 and bf16 (on AMX tiles, with AVX512-BF16 dots, and
through the portable fp32 path)."""

from __future__ import annotations

import pytest
import torch

from tests.cpu_levels import kernel_at
from yaied.kernels.cpu_prefill import CpuPrefillKernel
from yaied.worker.attention import (
    AttentionMetadata,
    PrefillChunk,
    _prefill_attention,
    paged_attention,
    write_kv,
)


@pytest.fixture
def kernel(isa_level):
    return kernel_at(CpuPrefillKernel, isa_level)


TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def make_case(dtype, kv_heads, group, head_dim, page_size, n, start_pos, seed=0):
    """A chunk of n queries at start_pos; its context's K/V sit in shuffled pages."""
    generator = torch.Generator().manual_seed(seed)
    context = start_pos + n
    num_pages = -(-context // page_size) + 3

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    k_cache = randn(kv_heads, num_pages, page_size, head_dim)
    v_cache = randn(kv_heads, num_pages, page_size, head_dim)
    pages = torch.randperm(num_pages, generator=generator)[: -(-context // page_size)]
    q = randn(n, kv_heads * group, head_dim) * 2
    return q, k_cache, v_cache, pages


def reference(q, k_cache, v_cache, pages, start_pos, scale):
    n, kv_heads = q.shape[0], k_cache.shape[0]
    context = start_pos + n
    mask = torch.arange(context)[None, :] <= torch.arange(start_pos, context)[:, None]
    # Over cached context the reference reads keys from the pages; k, v give only the kv heads.
    unused = q.new_zeros(n, kv_heads, q.shape[2])
    chunk = PrefillChunk(0, n, pages, mask, start_pos)
    return _prefill_attention(q, unused, unused, k_cache, v_cache, chunk, scale)


def use_path(kernel, path: str) -> torch.dtype:
    """Point the kernel at one of its bf16 paths (AMX tiles, AVX512-BF16 dots, or the slower
    portable fp32 one) or at fp32, skipping where this CPU lacks the path; returns the dtype to
    run. The tests put the flags back."""
    if path == "amx" and not kernel.has_amx:
        pytest.skip("this CPU (or its kernel build) has no AMX-BF16")
    if path == "bf16-dot" and not kernel.has_bf16_dot:
        pytest.skip("this CPU has no AVX512-BF16")
    kernel.use_amx = path == "amx"
    kernel.use_bf16_dot = path in ("amx", "bf16-dot")
    return torch.float32 if path == "fp32" else torch.bfloat16


@pytest.mark.parametrize(
    "dtype, path",
    [
        (torch.float32, "fp32"),
        (torch.bfloat16, "amx"),
        (torch.bfloat16, "bf16-dot"),
        (torch.bfloat16, "portable"),
    ],
    ids=["fp32", "bf16-amx", "bf16-dot", "bf16-portable"],
)
@pytest.mark.parametrize(
    "kv_heads, group, head_dim, page_size, n, start_pos",
    [
        (3, 3, 64, 16, 77, 0),  # the default model's heads, an odd fresh chunk
        (3, 3, 64, 16, 32, 16),  # the chunk starts on a page boundary
        (1, 4, 128, 16, 45, 333),  # extend mid-page over cached context
        (3, 3, 64, 16, 80, 608),  # a later chat turn: its new tokens over a long cached context
        (2, 1, 32, 4, 1, 50),  # one query
        (4, 2, 16, 1, 7, 20),  # page size 1
        (2, 5, 64, 8, 40, 3),  # group 5: padded rows in the register tiles
        (1, 8, 64, 16, 70, 0),  # 8 heads a kv head: every row in full AMX tiles
    ],
)
def test_kernel_matches_torch(
    kernel, dtype, path, kv_heads, group, head_dim, page_size, n, start_pos
):
    use_path(kernel, path)
    q, k_cache, v_cache, pages = make_case(
        dtype, kv_heads, group, head_dim, page_size, n, start_pos
    )
    scale = head_dim**-0.5
    try:
        ours = kernel(q, k_cache, v_cache, pages, start_pos, scale)
    finally:
        kernel.use_bf16_dot = kernel.use_amx = True
    theirs = reference(q, k_cache, v_cache, pages, start_pos, scale)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("path", ["amx", "bf16-dot", "portable", "fp32"])
def test_a_query_gets_the_same_bits_in_any_chunk(kernel, path):
    """The prefix cache relies on it: a prompt computed over its cached prefix gives the same
    greedy tokens as the same prompt fresh only if each query's row does not depend on where
    the chunk around it starts or ends."""
    dtype = use_path(kernel, path)
    q, k_cache, v_cache, pages = make_case(dtype, 3, 3, 64, 16, 150, 0, seed=3)
    try:
        whole = kernel(q, k_cache, v_cache, pages, 0, 0.125)
        for cuts in ([61], [16, 17, 100], [1, 149]):
            bounds = [0, *cuts, 150]
            parts = [
                kernel(q[a:b], k_cache, v_cache, pages, a, 0.125)
                for a, b in zip(bounds, bounds[1:], strict=False)
            ]
            assert torch.equal(torch.cat(parts), whole), cuts
    finally:
        kernel.use_bf16_dot = kernel.use_amx = True


@pytest.mark.parametrize("path", ["amx", "bf16-dot", "portable", "fp32"])
def test_a_chat_chain_gets_the_bits_of_one_fresh_prompt(kernel, path):
    """The same at a chat's length: eight turns of a ``previous_response_id`` chain, each a
    chunk over the cache the turns before it left (the last one new tokens over 624 cached, the
    shape of issue 33's turn 8), give every query the bits of the whole prompt computed at once;
    the context spans 22 key blocks, so each row's running maximum moves many times."""
    dtype = use_path(kernel, path)
    q, k_cache, v_cache, pages = make_case(dtype, 3, 3, 64, 16, 703, 0, seed=5)
    q = q * 2  # sharper scores: the running maximums move more often
    try:
        whole = kernel(q, k_cache, v_cache, pages, 0, 0.125)
        bounds = [0, 90, 171, 259, 350, 437, 526, 624, 703]
        parts = [
            kernel(q[a:b], k_cache, v_cache, pages, a, 0.125)
            for a, b in zip(bounds, bounds[1:], strict=False)
        ]
        assert torch.equal(torch.cat(parts), whole)
    finally:
        kernel.use_bf16_dot = kernel.use_amx = True


@pytest.mark.parametrize("path", ["amx", "bf16-dot", "portable", "fp32"])
def test_many_chunks_in_one_call_give_each_its_own_bits(kernel, path):
    """``chunks`` (one thread a chunk; engine.batch_invariant's one-token decodes) against a
    call a chunk: sequences of one query and of several, over their own shuffled pages."""
    dtype = use_path(kernel, path)
    generator = torch.Generator().manual_seed(4)
    kv_heads, group, head_dim, page_size, num_pages = 3, 3, 64, 16, 120
    k_cache = torch.randn(kv_heads, num_pages, page_size, head_dim, generator=generator)
    v_cache = torch.randn(kv_heads, num_pages, page_size, head_dim, generator=generator)
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    layout = [(1, 0), (1, 300), (5, 40), (1, 17), (33, 200), (1, 1000)]  # (rows, first position)
    q = torch.randn(sum(n for n, _ in layout), kv_heads * group, head_dim, generator=generator)
    q = q.to(dtype)
    tables, info, row = [], [], 0
    for n, start in layout:
        used = -(-(start + n) // page_size)
        info.append([row, n, start, sum(len(t) for t in tables)])
        tables.append(torch.randperm(num_pages, generator=generator)[:used])
        row += n
    try:
        out = torch.empty_like(q)
        chunks = torch.tensor(info, dtype=torch.int64)
        kernel.chunks(q, k_cache, v_cache, torch.cat(tables), chunks, 0.125, out)
        for (first, n, start, _), table in zip(info, tables, strict=True):
            one = kernel(q[first : first + n], k_cache, v_cache, table, start, 0.125)
            assert torch.equal(out[first : first + n], one), (n, start)
    finally:
        kernel.use_bf16_dot = kernel.use_amx = True


def test_paged_attention_runs_chunks_through_the_kernel(kernel):
    """Two chunks in one step (a fresh one and an extend), written by slot mapping first, as the
    model does: the kernel path equals the torch path."""
    torch.manual_seed(1)
    kv_heads, group, head_dim, page_size = 3, 3, 64, 16
    k_cache = torch.randn(kv_heads, 20, page_size, head_dim)
    v_cache = torch.randn_like(k_cache)
    lengths, starts = [37, 20], [0, 50]
    page_lists = [torch.arange(0, 3), torch.arange(10, 15)]
    slots = torch.cat(
        [
            (p[:, None] * page_size + torch.arange(page_size)).flatten()[s : s + n]
            for p, s, n in zip(page_lists, starts, lengths, strict=True)
        ]
    )
    n = sum(lengths)
    q, k, v = (torch.randn(n, h, head_dim) for h in (kv_heads * group, kv_heads, kv_heads))
    write_kv(k_cache, v_cache, k, v, slots)
    torch_chunks, kernel_chunks = [], []
    for row, (p, s, count) in enumerate(zip(page_lists, starts, lengths, strict=True)):
        first = sum(lengths[:row])
        context = s + count
        mask = torch.arange(context)[None, :] <= torch.arange(s, context)[:, None]
        torch_chunks.append(
            PrefillChunk(first, count, None if s == 0 else p, None if s == 0 else mask, s)
        )
        kernel_chunks.append(PrefillChunk(first, count, p, None, s))
    torch_meta = AttentionMetadata(slots, [], torch_chunks)
    kernel_meta = AttentionMetadata(slots, [], kernel_chunks, prefill_kernel=kernel)
    theirs = paged_attention(q, k, v, k_cache, v_cache, torch_meta, 0.125)
    ours = paged_attention(q, k, v, k_cache, v_cache, kernel_meta, 0.125)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_launcher_checks_shapes(kernel):
    q, k_cache, v_cache, pages = make_case(torch.float32, 2, 2, 32, 4, 8, 0)
    with pytest.raises(ValueError, match="pages"):
        kernel(q, k_cache, v_cache, pages[:1], 0, 1.0)
    with pytest.raises(ValueError, match="int64"):
        kernel(q, k_cache, v_cache, pages.int(), 0, 1.0)
    with pytest.raises(ValueError, match="dtype"):
        kernel(q.bfloat16(), k_cache, v_cache, pages, 0, 1.0)


def test_path_names_the_body_that_runs(kernel):
    """What the start-up log reports: tiles or dot products only for bf16 with a head size that
    is a multiple of 64, and AMX only where the CPU has it and Linux granted the tiles."""
    assert kernel.path(torch.float32, 64) == "fp32"
    assert kernel.path(torch.bfloat16, 32) == "fp32"
    dot = "bf16-dot" if kernel.has_bf16_dot else "fp32"
    assert kernel.path(torch.bfloat16, 64) == ("amx" if kernel.has_amx and dot != "fp32" else dot)
    kernel.use_amx = False
    try:
        assert kernel.path(torch.bfloat16, 128) == dot
    finally:
        kernel.use_amx = True
