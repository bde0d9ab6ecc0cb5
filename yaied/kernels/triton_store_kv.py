"""Store a step's new K/V rows into the paged pools by slot mapping.

    k, v          [num_tokens, kv_heads, head_dim]
    k/v cache     [kv_heads, num_pages, page_size, head_dim]; slot = page * page_size + offset
    slot_mapping  [num_tokens]; a negative slot skips the row (padding rows of a CUDA graph)

One program per token copies every kv head of it; the torch reference is ``store_kv_reference``
(the same index_copy_ the CPU path uses, minus the padding rule).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from yaied.kernels.triton_common import (
    check,
    check_cache,
    check_index,
    next_power_of_2,
)


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ch,
    stride_cs,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < KV_HEADS) & (dims[None, :] < HEAD_DIM)
    src_k = k_ptr + token.to(tl.int64) * stride_kt + heads[:, None] * stride_kh + dims[None, :]
    src_v = v_ptr + token.to(tl.int64) * stride_vt + heads[:, None] * stride_vh + dims[None, :]
    dst = heads[:, None].to(tl.int64) * stride_ch + slot * stride_cs + dims[None, :]
    tl.store(k_cache_ptr + dst, tl.load(src_k, mask=mask), mask=mask)
    tl.store(v_cache_ptr + dst, tl.load(src_v, mask=mask), mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write k/v rows into the pools in place (see the module docstring for shapes)."""
    check_cache(k_cache, v_cache)
    kv_heads, _, _, head_dim = k_cache.shape
    check(k.dim() == 3 and k.shape == v.shape, "k and v must both be [tokens, kv_heads, head_dim]")
    check(k.shape[1:] == (kv_heads, head_dim), f"k rows {tuple(k.shape[1:])} != cache rows")
    check(k.dtype == v.dtype == k_cache.dtype, "k, v and the caches differ in dtype")
    check(k.stride(2) == 1 and v.stride(2) == 1, "k and v rows must be contiguous")
    check(k.device == k_cache.device == v.device, "k, v and the caches are on different devices")
    check_index("slot_mapping", slot_mapping, 1, k.device)
    check(slot_mapping.shape[0] == k.shape[0], "slot_mapping needs one slot per token")
    if k.shape[0] == 0:
        return
    _store_kv_kernel[(k.shape[0],)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(2),
        KV_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=next_power_of_2(kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


def store_kv_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    keep = slot_mapping >= 0
    kv_heads, _, _, head_dim = k_cache.shape
    slots = slot_mapping[keep].long()
    k_cache.view(kv_heads, -1, head_dim).index_copy_(1, slots, k[keep].transpose(0, 1))
    v_cache.view(kv_heads, -1, head_dim).index_copy_(1, slots, v[keep].transpose(0, 1))
