"""bf16 KV pools under fp32 math (``cache.kv_cache_dtype``): the attention kernels widen each
bf16 K/V row to fp32 as they read it, so over bf16 pools they must give the bits they give over
the same pools widened to fp32, at every ISA level; the step's K/V write rounds each new row
once, as torch's ``.to(torch.bfloat16)`` does."""

from __future__ import annotations

import pytest
import torch

from tests.cpu_levels import kernel_at
from yaied.kernels.cpu_decode import CpuDecodeKernel
from yaied.kernels.cpu_prefill import CpuPrefillKernel
from yaied.worker.attention import write_kv
from yaied.worker.runner_setup import resolve_kv_dtype


def _pools(kv_heads, num_pages, page_size, head_dim, seed):
    torch.manual_seed(seed)
    shape = (kv_heads, num_pages, page_size, head_dim)
    return torch.randn(shape).to(torch.bfloat16), torch.randn(shape).to(torch.bfloat16)


@pytest.mark.parametrize(
    "kv_heads, group, head_dim, page_size", [(3, 3, 64, 16), (1, 4, 128, 16), (2, 2, 20, 1)]
)
def test_decode_over_bf16_pools_is_decode_over_them_widened(
    isa_level, kv_heads, group, head_dim, page_size
):
    kernel = kernel_at(CpuDecodeKernel, isa_level)
    lengths = [1, page_size + 1, 300, 700]  # 700: a long context, in partitions
    rows, max_pages = len(lengths), -(-max(lengths) // page_size)
    k_cache, v_cache = _pools(kv_heads, rows * max_pages + 2, page_size, head_dim, head_dim)
    table = torch.randperm(rows * max_pages + 2)[: rows * max_pages].view(rows, max_pages)
    q = torch.randn(rows, kv_heads * group, head_dim) * 2
    lens = torch.tensor(lengths, dtype=torch.int64)
    assert kernel.supports(torch.float32, group, head_dim, torch.bfloat16)
    ours = kernel(q, k_cache, v_cache, table, lens, head_dim**-0.5)
    widened = kernel(q, k_cache.float(), v_cache.float(), table, lens, head_dim**-0.5)
    assert ours.dtype == torch.float32
    assert torch.equal(ours, widened)


def test_decode_step_rounds_the_new_rows_once_then_attends_over_them(isa_level):
    kernel = kernel_at(CpuDecodeKernel, isa_level)
    kv_heads, group, head_dim, page_size, rows = 3, 3, 64, 16, 3
    heads = kv_heads * group
    lengths = [1, 17, 40]  # each row's new token is its last position
    max_pages = -(-max(lengths) // page_size)
    k_cache, v_cache = _pools(kv_heads, rows * max_pages + 1, page_size, head_dim, 3)
    table = torch.randperm(rows * max_pages + 1)[: rows * max_pages].view(rows, max_pages)
    lens = torch.tensor(lengths, dtype=torch.int64)
    positions = lens - 1
    slots = table.gather(1, (positions // page_size)[:, None])[:, 0] * page_size
    slots += positions % page_size
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim)
    freqs = positions.float()[:, None] * torch.rand(head_dim // 2)[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    scale = head_dim**-0.5

    out = kernel.step(qkv, heads, cos, sin, k_cache, v_cache, slots, table, lens, scale)
    # qkv now holds the rotated q and k: the pools hold the new k and v rounded to bf16 ...
    split = qkv.view(rows, -1, head_dim)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    write_kv(
        expected_k,
        expected_v,
        split[:, heads : heads + kv_heads],
        split[:, heads + kv_heads :],
        slots,
    )
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    # ... and the attention read them as the plain kernel reads their widened copy
    q = split[:, :heads].contiguous()
    widened = kernel(q, k_cache.float(), v_cache.float(), table, lens, scale)
    assert torch.equal(out.view(rows, heads, head_dim), widened)


@pytest.mark.parametrize("start_pos, num_tokens", [(0, 37), (300, 80)])
def test_prefill_over_bf16_pools_is_prefill_over_them_widened(isa_level, start_pos, num_tokens):
    kernel = kernel_at(CpuPrefillKernel, isa_level)
    kv_heads, group, head_dim, page_size = 3, 3, 64, 16
    context = start_pos + num_tokens
    num_pages = -(-context // page_size) + 2
    k_cache, v_cache = _pools(kv_heads, num_pages, page_size, head_dim, start_pos)
    pages = torch.randperm(num_pages)[: -(-context // page_size)]
    q = torch.randn(num_tokens, kv_heads * group, head_dim)
    scale = head_dim**-0.5
    assert kernel.supports(torch.float32, group, head_dim, torch.bfloat16)
    ours = kernel(q, k_cache, v_cache, pages, start_pos, scale)
    widened = kernel(q, k_cache.float(), v_cache.float(), pages, start_pos, scale)
    assert torch.equal(ours, widened)
    # and many chunks in one call: the same bits per chunk
    chunks = torch.tensor([[0, num_tokens, start_pos, 0]], dtype=torch.int64)
    out = torch.empty_like(q)
    kernel.chunks(q, k_cache, v_cache, pages, chunks, scale, out)
    assert torch.equal(out, ours)


def test_the_kernels_take_no_other_pairing(isa_level):
    decode = kernel_at(CpuDecodeKernel, isa_level)
    assert not decode.supports(torch.bfloat16, 3, 64, torch.float32)
    assert not CpuPrefillKernel.supports(torch.bfloat16, 3, 64, torch.float32)
    k_cache, v_cache = _pools(1, 2, 16, 64, 0)
    q = torch.randn(1, 1, 64).to(torch.bfloat16)
    with pytest.raises(ValueError, match="dtypes"):
        decode(q, k_cache.float(), v_cache.float(), torch.zeros(1, 1, dtype=torch.int64),
               torch.ones(1, dtype=torch.int64), 0.125)  # fmt: skip


CPU, CUDA = torch.device("cpu"), torch.device("cuda")
F32, BF16 = torch.float32, torch.bfloat16


@pytest.mark.parametrize(
    "name, dtype, weights, device, backend, expected",
    [
        ("auto", F32, BF16, CPU, "torch", BF16),  # dtype auto on a CPU without bf16 math
        ("auto", F32, F32, CPU, "torch", F32),  # --dtype float32 keeps fp32 pools
        ("auto", BF16, BF16, CPU, "torch", BF16),
        ("auto", F32, BF16, CPU, "triton", F32),  # the Triton kernels read the math's dtype
        ("auto", BF16, BF16, CUDA, "triton", BF16),
        ("bfloat16", F32, F32, CPU, "torch", BF16),
        ("float32", F32, BF16, CPU, "torch", F32),
        ("bfloat16", BF16, BF16, CUDA, "triton", BF16),
    ],
)
def test_which_pools(name, dtype, weights, device, backend, expected):
    assert resolve_kv_dtype(name, dtype, device, backend, weights) == expected


@pytest.mark.parametrize(
    "name, dtype, device, backend, message",
    [
        ("float32", BF16, CPU, "torch", "bfloat16 under float32 math"),
        ("bfloat16", F32, CUDA, "triton", "CPU kernels only"),
        ("bfloat16", F32, CPU, "triton", "CPU kernels only"),
    ],
)
def test_other_pairings_are_refused(name, dtype, device, backend, message):
    with pytest.raises(ValueError, match=message):
        resolve_kv_dtype(name, dtype, device, backend, dtype)
