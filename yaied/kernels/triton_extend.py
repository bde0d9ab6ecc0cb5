"""Extend (prefill) attention over a packed, variable-length batch of chunks.

Each chunk's new tokens attend causally to themselves and to everything before them in the
sequence: a prefix-cache hit or the earlier chunks of a chunked prefill. The new K/V are stored
into the pages first (triton_store_kv), so every key, old or new, is read from the pages:

    q, out        [num_tokens, num_heads, head_dim]  chunk i is rows [q_starts[i], q_starts[i+1])
    k/v cache     [kv_heads, num_pages, page_size, head_dim]
    page_table    [num_chunks, max_pages]  int32/int64, each sequence's pages in order
    q_starts      [num_chunks + 1]         row offsets, q_starts[0] = 0
    context_lens  [num_chunks]             positions after the chunk (prefix + chunk length)

    one chunk:  positions [0 ................ prefix | prefix ..... context_len)
                           cached keys (pages)         the chunk's queries (and its keys)
    query row r (position prefix + r) attends to keys at positions [0, prefix + r].

One program per (chunk, head, block of BLOCK_M query rows) runs an online softmax over key blocks
up to the block's last query position, so causality costs the skipped blocks nothing.
"""

from __future__ import annotations

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
)
from yaied.kernels.triton_decode import LOG2E


@triton.jit(do_not_specialize=["stride_tb"])  # the step's page-table width
def _extend_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, table_ptr, starts_ptr, lens_ptr, out_ptr,
    stride_qt, stride_qh, stride_ch, stride_cp, stride_cs, stride_tb, stride_ot, stride_oh,
    qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    chunk = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    block_m = tl.program_id(2)
    q_start = tl.load(starts_ptr + chunk).to(tl.int64)
    q_len = (tl.load(starts_ptr + chunk + 1) - q_start).to(tl.int32)
    if block_m * BLOCK_M >= q_len:
        return
    context_len = tl.load(lens_ptr + chunk).to(tl.int32)
    prefix = context_len - q_len

    rows = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_mask = rows < q_len
    dim_mask = dims < HEAD_DIM
    query_pos = prefix + rows
    q_offsets = (q_start + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :]
    io_mask = row_mask[:, None] & dim_mask[None, :]
    q = tl.load(q_ptr + q_offsets, mask=io_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    head_base = (head // GROUP).to(tl.int64) * stride_ch
    end = tl.minimum(context_len, prefix + (block_m + 1) * BLOCK_M)  # past the block's last row
    # Position 0 is visible to every row, so each row's running max is finite after the first
    # block and masked entries contribute exp2(-inf) = 0.
    for block in range(0, end, BLOCK_N):
        acc, m_i, l_i = attend_page_block(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table_ptr + chunk * stride_tb, head_base,
            block, end, query_pos, dims, dim_mask, stride_cp, stride_cs, qk_scale,
            PAGE_SIZE, BLOCK_N, True, PRECISION, UPCAST,
        )  # fmt: skip

    out = acc / l_i[:, None]
    out_offsets = (q_start + rows)[:, None] * stride_ot + head * stride_oh + dims[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=io_mask)


def extend_blocks(dtype: torch.dtype, head_dim: int, interpreted: bool) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): small tiles in the interpreter; on a GPU 64 x 64 for 16-bit inputs,
    32 x 32 for fp32 parity runs (ieee dots need twice the registers)."""
    if interpreted:
        return 16, 16
    if dtype == torch.float32 or head_dim > 128:
        return 32, 32
    return 64, 64


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    q_starts: torch.Tensor,
    context_lens: torch.Tensor,
    max_q_len: int,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each chunk over its whole context (module docstring). ``max_q_len``
    is the longest chunk, known on the host (the grid must not wait for the device)."""
    check_cache(k_cache, v_cache)
    kv_heads, _, page_size, head_dim = k_cache.shape
    check(q.dim() == 3 and q.shape[2] == head_dim, f"q must be [tokens, heads, {head_dim}]")
    num_heads = q.shape[1]
    check(num_heads % kv_heads == 0, f"{num_heads} heads do not group over {kv_heads} kv heads")
    check(q.dtype == k_cache.dtype and q.stride(2) == 1, "q must match the cache dtype, rows dense")
    check(q.device == k_cache.device, "q and the caches are on different devices")
    check_index("page_table", page_table, 2, q.device)
    check_index("q_starts", q_starts, 1, q.device)
    check_index("context_lens", context_lens, 1, q.device)
    num_chunks = context_lens.shape[0]
    check(page_table.shape[0] == num_chunks, "page_table needs one row per chunk")
    check(q_starts.shape[0] == num_chunks + 1, "q_starts needs num_chunks + 1 entries")
    check(max_q_len >= 0, "max_q_len must be >= 0")
    if out is None:
        out = torch.empty_like(q)
    check(out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1, "bad out tensor")
    if num_chunks == 0 or max_q_len == 0:
        return out
    interpreted = interpreting()
    block_m, block_n = extend_blocks(q.dtype, head_dim, interpreted)
    grid = (num_chunks, num_heads, triton.cdiv(max_q_len, block_m))
    _extend_kernel[grid](
        q, k_cache, v_cache, page_table, q_starts, context_lens, out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        page_table.stride(0), out.stride(0), out.stride(1), scale * LOG2E,
        GROUP=num_heads // kv_heads, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(head_dim),
        PRECISION=dot_precision(q.dtype), UPCAST=interpreted, num_warps=4,
    )  # fmt: skip
    return out


def extend_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    q_starts: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Chunk by chunk in fp32 with an explicit causal mask over the gathered context."""
    kv_heads, _, page_size, _ = k_cache.shape
    group = q.shape[1] // kv_heads
    out = torch.empty_like(q)
    for i in range(context_lens.shape[0]):
        start, stop, length = int(q_starts[i]), int(q_starts[i + 1]), int(context_lens[i])
        pos = torch.arange(length, device=q.device)
        pages = page_table[i].long()[pos // page_size]
        keys = k_cache[:, pages, pos % page_size].float().repeat_interleave(group, 0)
        values = v_cache[:, pages, pos % page_size].float().repeat_interleave(group, 0)
        query = q[start:stop].float().transpose(0, 1)  # [heads, n, head_dim]
        query_pos = torch.arange(length - (stop - start), length, device=q.device)
        visible = pos[None, :] <= query_pos[:, None]
        scores = (query @ keys.transpose(1, 2) * scale).masked_fill(~visible, float("-inf"))
        out[start:stop] = (torch.softmax(scores, -1) @ values).transpose(0, 1).to(q.dtype)
    return out
