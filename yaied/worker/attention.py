"""Paged attention in plain torch: the CPU path, and the reference for the Triton kernels.

The KV pool of one layer is two tensors ``[num_kv_heads, num_pages, page_size, head_dim]``; a slot
is ``page_id * page_size + offset``. Heads come first so that gathering a sequence's pages for one
head yields contiguous ``[context_len, head_dim]`` rows that batched matmuls read directly.
A step's tokens are packed into one row dimension:

    rows [0, num_decodes)                     one token per decoding sequence
    rows [num_decodes, num_tokens)            prefill chunks, one sequence after another

Decodes are batched: each bucket of decodes with similar context lengths gathers its sequences'
pages into one padded block and runs two batched matmuls over (kv head, sequence) pairs, the
grouped query heads of a kv head being the rows of its query matrix. (The CPU SDPA kernels are
tuned for long queries and run this shape an order of magnitude slower.) A prefill chunk with no
earlier context attends to its own fresh K/V (causal SDPA); a chunk over cached context gathers
that context and masks causally with the chunk at its end. On CPU, C kernels replace both where
they build (``KernelDecodes``, ``AttentionMetadata.prefill_kernel``): they read the pages in place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class DecodeBucket:
    start: int  # the bucket's decodes are rows [start, start + count) of the packed batch
    count: int
    page_table: torch.Tensor  # [count, max_pages] int64, padded with page 0
    # [kv_heads * count, 1, max_pages * page_size] in the model dtype: 0 where attended, -inf
    # past each sequence's end
    bias: torch.Tensor


@dataclass(slots=True)
class PrefillChunk:
    start: int  # first row of the chunk in the packed batch
    num_tokens: int  # query length
    # [num_pages] pages of the whole context, and the causal mask [num_tokens, context_len];
    # both None when the chunk is its whole context (it then attends to its own fresh K/V).
    # With a prefill kernel, pages are always set and the mask never: the kernel reads every
    # position from the pages and masks by position.
    pages: torch.Tensor | None
    mask: torch.Tensor | None
    start_pos: int = 0  # position of the chunk's first token; the context is [0, start_pos + n)


@dataclass(slots=True)
class KernelDecodes:
    """All decodes (rows [0, count)) for a fused decode kernel that reads pages in place."""

    kernel: Callable[..., torch.Tensor]  # (q, k_cache, v_cache, page_table, context_lens, scale)
    count: int
    page_table: torch.Tensor  # [count, max_pages] int64
    context_lens: torch.Tensor  # [count] int64
    # A decode-only step from the fused qkv rows, rotary and K/V write included:
    # (qkv, heads, cos, sin, k_cache, v_cache, slots, page_table, context_lens, scale) -> out
    step: Callable[..., torch.Tensor] | None = None
    # Every row decodes an output token (none is a prompt token): the decode loop may run the
    # step (worker/models/decode_loop.py). A prompt's tokens always take the layer path, so a
    # prompt computes the same whether its prefix was cached or not.
    output_decodes: bool = False


class AttentionBackend(Protocol):
    """A fused path that replaces both the K/V write and the attention of the torch path (the
    Triton kernels on a GPU: yaied.worker.gpu_packing.TritonAttention)."""

    def store(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None: ...

    def attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float
    ) -> torch.Tensor: ...


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's K/V is written
    decode_buckets: list[DecodeBucket]  # the torch path's decodes
    prefills: list[PrefillChunk]
    kernel_decodes: KernelDecodes | None = None  # set instead of buckets where a kernel runs
    # (q, k_cache, v_cache, pages, start_pos, scale, out=) -> out: runs every prefill chunk
    # where set (yaied.kernels.cpu_prefill)
    prefill_kernel: Callable[..., torch.Tensor] | None = None
    backend: AttentionBackend | None = None  # set instead of everything above on the GPU path
    # Chunks not in ``prefills``, too small for a fork-join each (TorchBatchPacker): the
    # prefill kernel's ``chunks`` runs them in one call, from (chunks [n, 4], every page table
    # flat).
    batched_chunks: tuple[torch.Tensor, torch.Tensor] | None = None

    def every_prefill(self, page_size: int) -> list[PrefillChunk]:
        """``prefills`` and the batched chunks, all as PrefillChunks with their pages: for the
        attention paths that take chunks one at a time (models/hf_attention.py's window)."""
        if self.batched_chunks is None:
            return self.prefills
        chunks, pages = self.batched_chunks
        return self.prefills + [
            PrefillChunk(first, n, pages[at : at + -(-(start + n) // page_size)], None, start)
            for first, n, start, at in chunks.tolist()
        ]


def store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
) -> None:
    """Write the step's new K/V rows into the pools, by the backend when there is one."""
    if meta.backend is not None:
        meta.backend.store(k_cache, v_cache, k, v)
    else:
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    # k, v: [num_tokens, kv_heads, head_dim]; caches viewed as [kv_heads, num_slots, head_dim]
    # (rounded to the pools' dtype where it is narrower: cache.kv_cache_dtype)
    kv_heads, _, _, head_dim = k_cache.shape
    k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    k_cache.view(kv_heads, -1, head_dim).index_copy_(1, slot_mapping, k.transpose(0, 1))
    v_cache.view(kv_heads, -1, head_dim).index_copy_(1, slot_mapping, v.transpose(0, 1))


def decode_step_attention(
    qkv: torch.Tensor,
    num_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor | None:
    """A step of decodes only, on the CPU kernel: rotary, the K/V write and attention in one
    call over the fused qkv rows [num_tokens, (heads + 2 * kv_heads) * head_dim] (cos, sin:
    [num_tokens, head_dim / 2] fp32). Returns [num_tokens, heads * head_dim], or None where the
    step has prefill rows or no such kernel: the caller then takes the general path."""
    fused = meta.kernel_decodes
    if fused is None or fused.step is None or fused.count != qkv.shape[0]:
        return None
    k_cache, v_cache = kv_cache
    return fused.step(
        qkv,
        num_heads,
        cos,
        sin,
        k_cache,
        v_cache,
        meta.slot_mapping,
        fused.page_table,
        fused.context_lens,
        scale,
    )


def gather_pages(
    cache: torch.Tensor, pages: torch.Tensor, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """cache: [kv_heads, num_pages, page_size, head_dim]; pages: [B, P] (or [P]) ->
    [kv_heads * B, P * page_size, head_dim] (or [kv_heads, P * page_size, head_dim]), in
    ``dtype`` where given (the activations', over bf16 pools under fp32 math)."""
    kv_heads, num_pages, page_size, head_dim = cache.shape
    gathered = cache.view(kv_heads, num_pages, -1).index_select(1, pages.reshape(-1))
    return gathered.view(-1, pages.shape[-1] * page_size, head_dim).to(dtype or cache.dtype)


def as_stored(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """Fresh K or V rows as a later read of the pool sees them: rounded to the pool's dtype
    and back where it is narrower (cache.kv_cache_dtype), so that a prompt attends to the same
    values whether its prefix was cached or not."""
    return x if cache.dtype == x.dtype else x.to(cache.dtype).to(x.dtype)


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
    if meta.backend is not None:
        return meta.backend.attend(q, k_cache, v_cache, scale)
    fused = meta.kernel_decodes
    if fused is not None and fused.count == q.shape[0]:  # decodes only: the kernel's output
        return fused.kernel(q, k_cache, v_cache, fused.page_table, fused.context_lens, scale)
    # Contiguous whatever q's strides (the prefill kernel writes its rows of out in place).
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if fused is not None:
        rows = slice(0, fused.count)
        out[rows] = fused.kernel(
            q[rows], k_cache, v_cache, fused.page_table, fused.context_lens, scale
        )
    for bucket in meta.decode_buckets:
        rows = slice(bucket.start, bucket.start + bucket.count)
        out[rows] = _decode_attention(q[rows], k_cache, v_cache, bucket, scale)
    if meta.batched_chunks is not None:
        chunks, pages = meta.batched_chunks
        meta.prefill_kernel.chunks(q, k_cache, v_cache, pages, chunks, scale, out)
    for chunk in meta.prefills:
        rows = slice(chunk.start, chunk.start + chunk.num_tokens)
        if meta.prefill_kernel is not None:
            meta.prefill_kernel(
                q[rows], k_cache, v_cache, chunk.pages, chunk.start_pos, scale, out=out[rows]
            )
        else:
            out[rows] = _prefill_attention(
                q[rows], k[rows], v[rows], k_cache, v_cache, chunk, scale
            )
    return out


def _decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    bucket: DecodeBucket,
    scale: float,
) -> torch.Tensor:
    # q: [b, num_heads, head_dim], the bucket's rows
    b, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[0]
    group = num_heads // kv_heads
    # Head h reads kv head h // group: query rows [kv_heads * b, group, head_dim].
    query = q.view(b, kv_heads, group, head_dim).transpose(0, 1).reshape(-1, group, head_dim)
    keys = gather_pages(k_cache, bucket.page_table, q.dtype)  # [kv_heads * b, max_len, head_dim]
    values = gather_pages(v_cache, bucket.page_table, q.dtype)
    scores = torch.baddbmm(bucket.bias, query, keys.transpose(1, 2), alpha=scale)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    result = torch.bmm(probs, values)  # [kv_heads * b, group, head_dim]
    return result.view(kv_heads, b, group, head_dim).transpose(0, 1).reshape(b, num_heads, -1)


def _prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    chunk: PrefillChunk,
    scale: float,
) -> torch.Tensor:
    query = q.transpose(0, 1).unsqueeze(0)  # [1, heads, n, head_dim]
    if chunk.pages is None:
        k, v = as_stored(k, k_cache), as_stored(v, v_cache)
        keys, values = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    else:
        context_len = chunk.mask.shape[1]
        keys = gather_pages(k_cache, chunk.pages, q.dtype)[:, :context_len].unsqueeze(0)
        values = gather_pages(v_cache, chunk.pages, q.dtype)[:, :context_len].unsqueeze(0)
    result = F.scaled_dot_product_attention(
        query,
        keys,
        values,
        attn_mask=chunk.mask,
        is_causal=chunk.mask is None,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return result.squeeze(0).transpose(0, 1)
