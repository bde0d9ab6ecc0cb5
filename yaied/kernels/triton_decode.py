"""Paged decode attention: one query token per sequence, K/V read in place from the pages.

    q, out        [batch, num_heads, head_dim]        head h reads kv head h // group
    k/v cache     [kv_heads, num_pages, page_size, head_dim]
    page_table    [batch, max_pages]   int32/int64, row b lists sequence b's pages in order
    context_lens  [batch]              row b attends to positions [0, context_lens[b]); 0 = none

Stage 1 runs one program per (sequence, kv head, split): the kv head's `group` query heads are
the rows of one tile (padded to 16 for tl.dot), so each K/V page is read once for the group.
The context is cut into `num_splits` equal runs of whole blocks, sized from each row's own
length inside the kernel: a batch of one long sequence then keeps every SM busy, and one launch
configuration serves every context length (what a CUDA graph needs). Each split leaves a partial
output and its log-sum-exp (base 2); stage 2 merges the splits per (sequence, head). With one
split, stage 1 writes the output directly and stage 2 is skipped.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from yaied.kernels.triton_common import (
    attend_page_block,
    check,
    check_cache,
    check_index,
    dot_precision,
    interpreting,
    next_power_of_2,
)

LOG2E = 1.4426950408889634
MAX_SPLITS = 16
MIN_SPLIT_TOKENS = 256  # shorter runs cost more in the merge than they gain in parallelism


# Arguments that change with the step (page-table width, split count) are not specialized on: a
# value of 1 or a multiple of 16 would otherwise compile another variant in the middle of serving.
@triton.jit(do_not_specialize=["stride_tb", "stride_lb", "stride_lh", "num_splits"])
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, table_ptr, lens_ptr, out_ptr, lse_ptr,
    stride_qb, stride_qh, stride_ch, stride_cp, stride_cs, stride_tb,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    qk_scale,  # softmax scale * log2(e): scores live in base 2
    num_splits,  # a runtime value: eager steps vary it, and each constexpr value is a compile
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(lens_ptr + seq).to(tl.int32)
    split_len = ((context_len + num_splits - 1) // num_splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, context_len)

    rows = tl.arange(0, BLOCK_H)  # query heads of this kv head, padded
    dims = tl.arange(0, BLOCK_D)
    row_mask = rows < GROUP
    dim_mask = dims < HEAD_DIM
    heads = kv_head * GROUP + rows
    q_offsets = seq * stride_qb + heads[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    head_base = kv_head.to(tl.int64) * stride_ch
    for block in range(start, end, BLOCK_N):
        acc, m_i, l_i = attend_page_block(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table_ptr + seq * stride_tb, head_base,
            block, end, rows, dims, dim_mask, stride_cp, stride_cs, qk_scale,
            PAGE_SIZE, BLOCK_N, False, PRECISION, UPCAST,
        )  # fmt: skip

    has_keys = end > start
    out = tl.where(has_keys, acc / tl.where(has_keys, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    out_offsets = seq * stride_ob + heads[:, None] * stride_oh + split * stride_os + dims[None, :]
    out_mask = row_mask[:, None] & dim_mask[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    tl.store(lse_ptr + seq * stride_lb + heads * stride_lh + split, lse, mask=row_mask)


@triton.jit(do_not_specialize=["stride_lb", "stride_lh", "num_splits"])
def _decode_merge_kernel(
    part_ptr, lse_ptr, out_ptr,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    num_splits, HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    split_mask = splits < num_splits
    lse = tl.load(
        lse_ptr + seq * stride_lb + head * stride_lh + splits, mask=split_mask, other=float("-inf")
    )
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # no keys at all: every weight is 0
    weights = tl.exp2(lse - top)
    total = tl.sum(weights, 0)
    part_offsets = seq * stride_pb + head * stride_ph + splits[:, None] * stride_ps + dims[None, :]
    mask = split_mask[:, None] & (dims[None, :] < HEAD_DIM)
    parts = tl.load(part_ptr + part_offsets, mask=mask, other=0.0)
    out = tl.sum(parts * weights[:, None], 0) / tl.where(total > 0, total, 1.0)
    out_offsets = seq * stride_ob + head * stride_oh + dims
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def choose_num_splits(
    batch: int, kv_heads: int, max_context_len: int, num_sms: int, page_size: int = 16
) -> int:
    """Splits along the context so that stage 1 has about two programs per SM, never more than
    MAX_SPLITS and never runs shorter than MIN_SPLIT_TOKENS (rounded to whole pages)."""
    check(batch >= 1 and kv_heads >= 1 and num_sms >= 1, "batch, kv_heads, num_sms must be >= 1")
    wanted = math.ceil(2 * num_sms / (batch * kv_heads))
    min_run = max(MIN_SPLIT_TOKENS, page_size)
    by_length = max(1, math.ceil(max_context_len / min_run))
    return max(1, min(wanted, by_length, MAX_SPLITS))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int = 1,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of each row's query over its pages (module docstring); returns ``out``."""
    check_cache(k_cache, v_cache)
    kv_heads, _, page_size, head_dim = k_cache.shape
    check(q.dim() == 3 and q.shape[2] == head_dim, f"q must be [batch, heads, {head_dim}]")
    batch, num_heads, _ = q.shape
    check(num_heads % kv_heads == 0, f"{num_heads} heads do not group over {kv_heads} kv heads")
    check(q.dtype == k_cache.dtype and q.stride(2) == 1, "q must match the cache dtype, rows dense")
    check(q.device == k_cache.device, "q and the caches are on different devices")
    check_index("page_table", page_table, 2, q.device)
    check_index("context_lens", context_lens, 1, q.device)
    check(page_table.shape[0] == batch and context_lens.shape[0] == batch, "one row per query")
    check(1 <= num_splits <= MAX_SPLITS, f"num_splits must be in 1..{MAX_SPLITS}")
    if out is None:
        out = torch.empty_like(q)
    check(out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1, "bad out tensor")
    if batch == 0:
        return out
    group = num_heads // kv_heads
    if num_splits == 1:  # stage 1 writes the output itself
        parts = out.unsqueeze(2)
        lse = torch.empty(batch, num_heads, 1, dtype=torch.float32, device=q.device)
    else:
        # fp32 partials whatever the default dtype is (a process may have set it to bf16)
        shape = (batch, num_heads, num_splits, head_dim)
        parts = torch.empty(shape, dtype=torch.float32, device=q.device)
        lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    interpreted = interpreting()
    _decode_split_kernel[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, page_table, context_lens, parts, lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        page_table.stride(0), parts.stride(0), parts.stride(1), parts.stride(2),
        lse.stride(0), lse.stride(1), scale * LOG2E,
        num_splits, GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        BLOCK_H=max(16, next_power_of_2(group)), BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_N=16 if interpreted else 64, PRECISION=dot_precision(q.dtype),
        UPCAST=interpreted, num_warps=4,
    )  # fmt: skip
    if num_splits > 1:
        _decode_merge_kernel[(batch, num_heads)](
            parts, lse, out,
            parts.stride(0), parts.stride(1), parts.stride(2), lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1),
            num_splits, HEAD_DIM=head_dim,
            BLOCK_S=next_power_of_2(num_splits), BLOCK_D=triton.next_power_of_2(head_dim),
        )  # fmt: skip
    return out


def paged_decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Row by row in fp32: gather the row's positions, softmax, weighted sum."""
    kv_heads, _, page_size, _ = k_cache.shape
    group = q.shape[1] // kv_heads
    out = torch.zeros_like(q)
    for row in range(q.shape[0]):
        length = int(context_lens[row])
        if length == 0:
            continue
        pos = torch.arange(length, device=q.device)
        pages = page_table[row].long()[pos // page_size]
        keys = k_cache[:, pages, pos % page_size].float()  # [kv_heads, length, head_dim]
        values = v_cache[:, pages, pos % page_size].float()
        query = q[row].float().view(kv_heads, group, -1)
        probs = torch.softmax(query @ keys.transpose(1, 2) * scale, dim=-1)
        out[row] = (probs @ values).reshape(q.shape[1], -1).to(q.dtype)
    return out
