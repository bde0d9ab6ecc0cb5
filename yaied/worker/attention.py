"""Paged attention in plain torch: the CPU path, and the reference for the Triton kernels.

The KV pool of one layer is two tensors ``[num_pages, page_size, num_kv_heads, head_dim]``; a slot
is ``page_id * page_size + offset``. A step's tokens are packed into one row dimension:

    rows [0, num_decodes)                     one token per decoding sequence
    rows [num_decodes, num_tokens)            prefill chunks, one sequence after another

Decodes are batched: each bucket of decodes with similar context lengths gathers its sequences'
pages into one padded ``[B, max_len]`` block (whole pages, so the gather copies contiguous runs)
and runs one attention call. Grouped-query heads are folded into query rows
(``[B, kv_heads, group, head_dim]``), which the CPU kernels run much faster than their GQA path.
A prefill chunk with no earlier context attends to its own fresh K/V (causal); a chunk over
cached context gathers that context and masks causally with the chunk at its end.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class DecodeBucket:
    rows: torch.Tensor  # [B] int64: the rows of these decodes in the packed batch
    page_table: torch.Tensor  # [B, max_pages] int64, padded with page 0
    bias: torch.Tensor  # [B, 1, 1, max_pages * page_size]: 0 where attended, -inf past the end


@dataclass(slots=True)
class PrefillChunk:
    start: int  # first row of the chunk in the packed batch
    num_tokens: int  # query length
    # [num_pages] pages of the whole context, and the causal mask [num_tokens, context_len];
    # both None when the chunk is its whole context (it then attends to its own fresh K/V).
    pages: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's K/V is written
    decode_buckets: list[DecodeBucket]
    prefills: list[PrefillChunk]


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    # k, v: [num_tokens, num_kv_heads, head_dim]; caches viewed as [num_slots, kv_heads, head_dim]
    kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def gather_pages(cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """cache: [num_pages, page_size, kv_heads, head_dim]; pages: [..., P] ->
    [..., kv_heads, P * page_size, head_dim] (the heads-first layout attention wants)."""
    num_pages, page_size, kv_heads, head_dim = cache.shape
    gathered = cache.view(num_pages, -1).index_select(0, pages.reshape(-1))
    gathered = gathered.view(*pages.shape[:-1], pages.shape[-1] * page_size, kv_heads, head_dim)
    return gathered.transpose(-3, -2)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim] (already
    written to the pool). Returns [num_tokens, num_heads, head_dim]."""
    out = torch.empty_like(q)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    for bucket in meta.decode_buckets:
        b = bucket.rows.shape[0]
        # Head h reads kv head h // group, so the query heads fold into [b, kv_heads, group, d].
        query = q.index_select(0, bucket.rows).view(b, num_kv_heads, group, head_dim)
        keys = gather_pages(k_cache, bucket.page_table)  # [b, kv_heads, max_len, d]
        values = gather_pages(v_cache, bucket.page_table)
        result = F.scaled_dot_product_attention(
            query, keys, values, attn_mask=bucket.bias.to(q.dtype), scale=scale
        )
        out.index_copy_(0, bucket.rows, result.view(b, num_heads, head_dim))
    gqa = group != 1
    for chunk in meta.prefills:
        rows = slice(chunk.start, chunk.start + chunk.num_tokens)
        query = q[rows].transpose(0, 1).unsqueeze(0)  # [1, heads, n, head_dim]
        if chunk.pages is None:
            keys = k[rows].transpose(0, 1).unsqueeze(0)
            values = v[rows].transpose(0, 1).unsqueeze(0)
        else:
            context_len = chunk.mask.shape[1]
            keys = gather_pages(k_cache, chunk.pages)[:, :context_len].unsqueeze(0)
            values = gather_pages(v_cache, chunk.pages)[:, :context_len].unsqueeze(0)
        out[rows] = (
            F.scaled_dot_product_attention(
                query,
                keys,
                values,
                attn_mask=chunk.mask,
                is_causal=chunk.mask is None,
                scale=scale,
                enable_gqa=gqa,
            )
            .squeeze(0)
            .transpose(0, 1)
        )
    return out
