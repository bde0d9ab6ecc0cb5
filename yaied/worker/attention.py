"""Paged attention in plain torch: the CPU path, and the reference for the Triton kernels.

The KV pool of one layer is two tensors ``[num_slots, num_kv_heads, head_dim]``; a slot is
``page_id * page_size + offset``. A step's tokens are packed into one row dimension:

    rows [0, num_decodes)                     one token per decoding sequence, batched together
    rows [num_decodes, num_tokens)            prefill chunks, one sequence after another

Decodes are batched by gathering each sequence's slots into a padded ``[B, max_len]`` index. Prefill
chunks attend one sequence at a time: a chunk with no earlier context attends to its own fresh K/V
(causal), a chunk over cached context gathers that context from the pool and masks causally with the
chunk sitting at the end of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillChunk:
    start: int  # first row of the chunk in the packed batch
    num_tokens: int  # query length
    context_len: int  # tokens attended to, including this chunk (= its end position)
    # [context_len] slots of the whole context; None when the chunk is the whole context.
    context_slots: torch.Tensor | None
    # [num_tokens, context_len] True where attention is allowed; None when context_slots is None.
    mask: torch.Tensor | None


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's K/V is written
    num_decodes: int
    decode_slots: torch.Tensor | None  # [num_decodes, max_len] int64, padded with slot 0
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_len] bool, True = attend
    prefills: list[PrefillChunk]


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    # k, v: [num_tokens, num_kv_heads, head_dim]
    k_cache.index_copy_(0, slot_mapping, k)
    v_cache.index_copy_(0, slot_mapping, v)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim] (already in
    the pool). Returns [num_tokens, num_heads, head_dim]."""
    out = torch.empty_like(q)
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    gqa = num_heads != num_kv_heads
    b = meta.num_decodes
    if b:
        keys = k_cache[meta.decode_slots].transpose(1, 2)  # [B, kv_heads, max_len, head_dim]
        values = v_cache[meta.decode_slots].transpose(1, 2)
        out[:b] = F.scaled_dot_product_attention(
            q[:b].unsqueeze(2),
            keys,
            values,
            attn_mask=meta.decode_mask,
            scale=scale,
            enable_gqa=gqa,
        ).squeeze(2)
    for chunk in meta.prefills:
        rows = slice(chunk.start, chunk.start + chunk.num_tokens)
        query = q[rows].transpose(0, 1).unsqueeze(0)  # [1, heads, n, head_dim]
        if chunk.context_slots is None:
            keys, values, mask, causal = k[rows], v[rows], None, True
        else:
            keys, values = k_cache[chunk.context_slots], v_cache[chunk.context_slots]
            mask, causal = chunk.mask, False
        out[rows] = (
            F.scaled_dot_product_attention(
                query,
                keys.transpose(0, 1).unsqueeze(0),
                values.transpose(0, 1).unsqueeze(0),
                attn_mask=mask,
                is_causal=causal,
                scale=scale,
                enable_gqa=gqa,
            )
            .squeeze(0)
            .transpose(0, 1)
        )
    return out
