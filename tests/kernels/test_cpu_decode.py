"""The CPU paged decode kernel against the torch reference path, on shapes that stress it."""

from __future__ import annotations

import random

import pytest
import torch

from tests.cpu_levels import LEVELS, kernel_at
from yaied.kernels.cpu_decode import CpuDecodeKernel
from yaied.worker.attention import DecodeBucket, _decode_attention


@pytest.fixture
def kernel(isa_level):
    return kernel_at(CpuDecodeKernel, isa_level)


def reference(q, k_cache, v_cache, table, lengths, scale):
    kv_heads, _, page_size, _ = k_cache.shape
    positions = torch.arange(table.shape[1] * page_size)
    past_end = positions[None, :] >= lengths[:, None]
    bias = torch.zeros(past_end.shape, dtype=q.dtype).masked_fill_(past_end, float("-inf"))
    bucket = DecodeBucket(0, q.shape[0], table, bias.repeat(kv_heads, 1).unsqueeze(1))
    return _decode_attention(q, k_cache, v_cache, bucket, scale)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 4e-2)])
@pytest.mark.parametrize(
    "kv_heads, group, head_dim, page_size",
    [(3, 3, 64, 16), (2, 1, 32, 4), (1, 4, 128, 16), (4, 2, 16, 1)],
)
def test_kernel_matches_torch_path(kernel, dtype, tolerance, kv_heads, group, head_dim, page_size):
    rng = random.Random(head_dim + group)
    torch.manual_seed(0)
    rows = 7
    lengths = [1, page_size, page_size + 1] + [rng.randint(1, 150) for _ in range(rows - 3)]
    max_pages = -(-max(lengths) // page_size)
    num_pages = rows * max_pages + 5
    # Each row owns distinct, shuffled pages, as the page pool hands them out.
    table = torch.randperm(num_pages)[: rows * max_pages].view(rows, max_pages)
    k_cache = torch.randn(kv_heads, num_pages, page_size, head_dim).to(dtype)
    v_cache = torch.randn(kv_heads, num_pages, page_size, head_dim).to(dtype)
    q = (torch.randn(rows, kv_heads * group, head_dim) * 2).to(dtype)
    lens = torch.tensor(lengths, dtype=torch.int64)
    scale = head_dim**-0.5
    ours = kernel(q, k_cache, v_cache, table, lens, scale)
    theirs = reference(q, k_cache, v_cache, table, lens, scale)
    # bf16: the reference rounds probabilities to bf16 before P @ V, the kernel keeps fp32.
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=tolerance, atol=tolerance)


def test_a_row_does_not_depend_on_the_rest_of_the_batch(kernel):
    """Bit for bit: a request's output must not change with what it is batched with (seeded
    sampling relies on it), so the kernel's work split may not depend on the number of rows."""
    torch.manual_seed(5)
    kv_heads, group, head_dim, page_size, rows = 3, 3, 64, 16, 6
    lengths = [700, 20, 333, 1, 64, 999]
    max_pages = -(-max(lengths) // page_size)
    num_pages = rows * max_pages
    table = torch.randperm(num_pages).view(rows, max_pages)
    k_cache = torch.randn(kv_heads, num_pages, page_size, head_dim).to(torch.bfloat16)
    v_cache = torch.randn(kv_heads, num_pages, page_size, head_dim).to(torch.bfloat16)
    q = torch.randn(rows, kv_heads * group, head_dim).to(torch.bfloat16)
    lens = torch.tensor(lengths, dtype=torch.int64)
    together = kernel(q, k_cache, v_cache, table, lens, 0.125)
    for r in range(rows):
        alone = kernel(q[r : r + 1], k_cache, v_cache, table[r : r + 1], lens[r : r + 1], 0.125)
        assert torch.equal(alone[0], together[r])


def _long_rows(lengths, kv_heads, group, head_dim, page_size, dtype, seed):
    torch.manual_seed(seed)
    rows = len(lengths)
    max_pages = -(-max(lengths) // page_size)
    table = torch.randperm(rows * max_pages + 3)[: rows * max_pages].view(rows, max_pages)
    shape = (kv_heads, rows * max_pages + 3, page_size, head_dim)
    k_cache, v_cache = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    q = (torch.randn(rows, kv_heads * group, head_dim) * 2).to(dtype)
    return q, k_cache, v_cache, table, torch.tensor(lengths, dtype=torch.int64)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 4e-2)])
@pytest.mark.parametrize("kv_heads, group, head_dim", [(3, 3, 64), (1, 4, 128)])
def test_long_contexts_in_partitions_match_torch_path(
    kernel, dtype, tolerance, kv_heads, group, head_dim
):
    """Contexts past one partition (256 positions) are split and merged; past 16 partitions
    the partitions grow (5000 positions: 10 of 512)."""
    lengths = [256, 257, 549, 1, 4096, 5000]
    args = _long_rows(lengths, kv_heads, group, head_dim, 16, dtype, seed=head_dim)
    ours = kernel(*args, head_dim**-0.5)
    theirs = reference(*args, head_dim**-0.5)
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=tolerance, atol=tolerance)


@pytest.mark.skipif("avx512_bf16" not in LEVELS, reason="this CPU has no AVX512-BF16")
@pytest.mark.parametrize(
    "kv_heads, group, head_dim, page_size",
    [
        *[(3, 3, 64, 16), (2, 4, 64, 16), (1, 4, 128, 16), (1, 8, 128, 16)],  # constant copies
        *[(2, 1, 64, 16), (1, 7, 128, 16), (2, 4, 64, 4), (1, 5, 128, 32)],  # groups at run time
        *[(2, 3, 32, 16), (1, 6, 96, 8)],  # head sizes at run time
        *[(1, 9, 64, 16), (1, 2, 48, 16), (1, 2, 160, 16)],  # the widening body's
    ],
)
def test_the_bf16_dot_body_computes_what_the_widening_body_does(
    kv_heads, group, head_dim, page_size
):
    """At avx512_bf16, bf16 K/V of head sizes 32 to 128 (multiples of 32) in groups of up to 8
    take the dot body (q . k by vdpbf16ps, 16 positions a block); at avx512 the widening body
    runs. The products
    are exact in both and only the order of the fp32 sums differs, so each output is within
    one bf16 step (plus the sums' own rounding) of the other's: over page tails, partial
    blocks, one position, and contexts split into partitions (past 256 positions)."""
    lengths = [1, 15, 16, 17, 33, 255, 256, 300, 700, 1500]
    args = _long_rows(lengths, kv_heads, group, head_dim, page_size, torch.bfloat16, seed=group)
    dot = kernel_at(CpuDecodeKernel, "avx512_bf16")(*args, head_dim**-0.5).float()
    widening = kernel_at(CpuDecodeKernel, "avx512")(*args, head_dim**-0.5).float()
    larger = torch.maximum(dot.abs(), widening.abs()).clamp_min(2**-126)
    step = 2.0 ** (torch.floor(torch.log2(larger)) - 7)  # a bf16 step at that magnitude
    assert ((dot - widening).abs() <= step + 1e-5).all()
    assert (dot == widening).float().mean() > 0.9  # mostly the same bf16 outright


def test_a_row_does_not_depend_on_the_threads(kernel):
    """The partitions of a long context depend on its length alone: one thread computes the
    same bits as the whole team."""
    args = _long_rows([700, 3, 1500], 3, 3, 64, 16, torch.bfloat16, seed=9)
    threads = torch.get_num_threads()
    team = kernel(*args, 0.125)
    try:
        torch.set_num_threads(1)
        alone = kernel(*args, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, team)


def test_launcher_checks_shapes(kernel):
    k = torch.zeros(2, 4, 16, 32)
    with pytest.raises(ValueError, match="shapes"):
        kernel(
            torch.zeros(1, 4, 64),
            k,
            k,
            torch.zeros(1, 1, dtype=torch.int64),
            torch.ones(1, dtype=torch.int64),
            1.0,
        )
    with pytest.raises(ValueError, match="int64"):
        kernel(
            torch.zeros(1, 4, 32),
            k,
            k,
            torch.zeros(1, 1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int64),
            1.0,
        )


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 4e-2)])
@pytest.mark.parametrize("kv_heads, group, head_dim, page_size", [(3, 3, 64, 16), (2, 2, 32, 4)])
def test_step_is_rotary_then_write_then_attention(
    kernel, dtype, tolerance, kv_heads, group, head_dim, page_size
):
    """The decode-only step entry against the three torch references it replaces: rotary on q
    and k of the fused qkv rows, the K/V write at each row's slot, attention that sees it."""
    from yaied.kernels.cpu_fused import rotary_reference
    from yaied.worker.attention import write_kv

    torch.manual_seed(1)
    heads, rows = kv_heads * group, 4
    lengths = [1, page_size, page_size + 1, 3 * page_size + 2]  # the new token is the last
    max_pages = -(-max(lengths) // page_size)
    num_pages = rows * max_pages + 3
    table = torch.randperm(num_pages)[: rows * max_pages].view(rows, max_pages)
    lens = torch.tensor(lengths, dtype=torch.int64)
    positions = lens - 1
    slots = table.gather(1, (positions // page_size)[:, None])[:, 0] * page_size
    slots += positions % page_size
    k_cache = torch.randn(kv_heads, num_pages, page_size, head_dim).to(dtype)
    v_cache = torch.randn(kv_heads, num_pages, page_size, head_dim).to(dtype)
    # qkv rows with padding after them: the kernel honours the row stride
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(rows, width + 8).to(dtype)[:, :width]
    freqs = positions.float()[:, None] * torch.rand(head_dim // 2)[None, :]
    cos, sin = freqs.cos(), freqs.sin()

    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    split = qkv.float().view(rows, -1, head_dim)
    full_cos, full_sin = torch.cat((cos, cos), -1)[:, None], torch.cat((sin, sin), -1)[:, None]
    rotated = rotary_reference(split[:, : heads + kv_heads], full_cos, full_sin).to(dtype)
    q, k = rotated[:, :heads], rotated[:, heads:]
    v = split[:, heads + kv_heads :].to(dtype)
    write_kv(expected_k, expected_v, k, v, slots)
    expected = reference(q, expected_k, expected_v, table, lens, head_dim**-0.5)

    out = kernel.step(qkv, heads, cos, sin, k_cache, v_cache, slots, table, lens, head_dim**-0.5)
    assert out.shape == (rows, heads * head_dim)
    close = dict(rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(qkv.view(rows, -1, head_dim)[:, :heads].float(), q.float(), **close)
    torch.testing.assert_close(k_cache.float(), expected_k.float(), **close)
    torch.testing.assert_close(v_cache, expected_v)  # copied, not computed
    torch.testing.assert_close(out.view(rows, heads, -1).float(), expected.float(), **close)


@pytest.mark.parametrize(
    "math, pools",
    [(torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16,) * 2],
)
@pytest.mark.parametrize(
    "first_len, rows, group, head_dim",
    [
        (40, 5, 3, 64),
        (254, 5, 3, 64),
        (4094, 5, 3, 64),
        (700, 7, 3, 64),
        (100, 4, 4, 64),
        (30, 3, 1, 64),
        (300, 3, 4, 128),
    ],
)
def test_a_drafted_run_shares_its_reads_and_keeps_each_rows_bits(
    kernel, math, pools, first_len, rows, group, head_dim
):
    """Speculative verification rows (one sequence, consecutive positions, the same pages) share
    the kernel's work items, each K/V block read once for all of them (under bf16 math with bf16
    dot products, the dot body's items too): every row must still be the bits it is alone. The
    lengths straddle a partition's edge (256) and the longer partitions past 4096; runs longer
    than MAX_GROUP query heads split, and so do the dot body's passes (4 heads of 128 a pass); a
    decode of another sequence sits beside them."""
    torch.manual_seed(first_len)
    kv_heads, page_size = 2, 16
    lengths = [first_len + j for j in range(rows)] + [77]
    max_pages = -(-max(lengths) // page_size)
    num_pages = 2 * max_pages + 1
    own = torch.randperm(num_pages)[: 2 * max_pages].view(2, max_pages)
    table = torch.cat([own[:1].repeat(rows, 1), own[1:]])  # the run's rows share their pages
    shape = (kv_heads, num_pages, page_size, head_dim)
    k_cache, v_cache = torch.randn(shape).to(pools), torch.randn(shape).to(pools)
    q = torch.randn(rows + 1, kv_heads * group, head_dim).to(math)
    lens = torch.tensor(lengths, dtype=torch.int64)
    together = kernel(q, k_cache, v_cache, table, lens, 0.125)
    for r in range(rows + 1):
        alone = kernel(q[r : r + 1], k_cache, v_cache, table[r : r + 1], lens[r : r + 1], 0.125)
        assert torch.equal(alone[0], together[r]), f"row {r}"
    reference_rows = reference(q.float(), k_cache.float(), v_cache.float(), table, lens, 0.125)
    tolerance = 1e-5 if math == torch.float32 else 1e-2
    torch.testing.assert_close(together.float(), reference_rows, rtol=tolerance, atol=tolerance)
