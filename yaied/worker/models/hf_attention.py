"""The attention function transformers' model classes call when they run on yaied's paged KV cache.

transformers modules compute q/k/v themselves (projections, rotary or absolute positions, q/k
norms) and hand them to whatever function ``config._attn_implementation`` names in its
``AttentionInterface``. We register one that writes the new K/V into the layer's pages and attends
over each sequence's pages, exactly as the native models do (attention.py). The step's tensors
reach it as a keyword argument that every model forwards from its ``forward(**kwargs)`` down to
the attention call:

    base_model(input_ids=[1, num_tokens], position_ids=[1, num_tokens], yaied_paged=PagedContext)

The whole step is one batch row (the runner's packed layout), so transformers never builds a mask:
its mask helpers return None for an attention implementation that has no mask function.

Sliding windows and attention-logit softcapping (Mistral, Phi-3, Gemma 2) take a masked path
that spells the scores out; without them the step reuses the native paths (the CPU decode kernel,
bucketed decodes, SDPA prefills). Sliding-window layers keep every page: the window is a mask,
which costs memory but never changes which pages the prefix cache may share.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from yaied.worker.attention import (
    AttentionMetadata,
    as_stored,
    gather_pages,
    paged_attention,
    write_kv,
)

ATTENTION_NAME = "yaied_paged"


@dataclass(slots=True)
class PagedContext:
    """One step's paged-attention inputs, or (kv_caches None) a probe that records K shapes."""

    kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None
    meta: AttentionMetadata | None
    positions: torch.Tensor  # [num_tokens] int64
    max_position: int  # the step's largest position: windows shorter than it need masking
    probed: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # layer -> (h, kv, d)
    unsupported: list[str] = field(default_factory=list)  # what the probe saw that we lack

    def probe(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kwargs) -> None:
        """Record layer's head layout, and what its attention call needs that the pages lack."""
        if layer in self.probed:
            self.unsupported.append(f"layer {layer} attends twice per step over one K/V")
        if v.shape[2] != k.shape[2]:
            self.unsupported.append(f"values have head size {v.shape[2]}, keys {k.shape[2]}")
        if kwargs.get("s_aux") is not None:
            self.unsupported.append("its attention has sink logits (s_aux)")
        self.probed[layer] = (q.shape[1], k.shape[1], k.shape[2])


class NoPagedContext(ValueError):
    """The attention call came without the step's PagedContext."""


def register_attention() -> None:
    """Make ``attn_implementation="yaied_paged"`` known to transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)


def paged_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    yaied_paged: PagedContext | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """query: [1, num_heads, num_tokens, head_dim]; key, value: [1, kv_heads, num_tokens,
    head_dim]. Returns ([1, num_tokens, num_heads, head_dim], None), as transformers expects."""
    if yaied_paged is None:
        raise NoPagedContext(f"{ATTENTION_NAME} attention runs only inside yaied's model runner")
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise ValueError(f"{type(module).__name__} has no layer_idx to find its KV pages by")
    q = query[0].transpose(0, 1).contiguous()  # [n, num_heads, head_dim]
    k = key[0].transpose(0, 1)  # [n, kv_heads, head_dim]
    v = value[0].transpose(0, 1)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    ctx = yaied_paged
    if ctx.kv_caches is None or ctx.meta is None:
        ctx.probe(layer, q, k, v, kwargs)
        return q.new_zeros(q.shape[0], q.shape[1], v.shape[2]).unsqueeze(0), None
    k_cache, v_cache = ctx.kv_caches[layer]
    if k_cache.shape[0] != k.shape[1] or k_cache.shape[3] != k.shape[2]:
        raise ValueError(f"layer {layer}: K of shape {tuple(k.shape)} does not fit its KV pool")
    write_kv(k_cache, v_cache, k, v, ctx.meta.slot_mapping)
    if sliding_window is not None and sliding_window > ctx.max_position:
        sliding_window = None  # no key is old enough to fall out of the window
    if sliding_window is None and softcap is None:
        out = paged_attention(q, k, v, k_cache, v_cache, ctx.meta, scale)
    else:
        window = Window(scale, sliding_window, softcap)
        out = masked_paged_attention(q, k, v, k_cache, v_cache, ctx, window)
    return out.unsqueeze(0), None


@dataclass(frozen=True, slots=True)
class Window:
    """What the masked path does beyond plain causal attention."""

    scale: float
    sliding_window: int | None  # a key is seen iff query_pos - window < key_pos <= query_pos
    softcap: float | None  # scores become softcap * tanh(scores / softcap) before masking


def _attend(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    allowed: torch.Tensor,
    window: Window,
) -> torch.Tensor:
    """query [B, R, d], keys/values [B, L, d], allowed [B, R, L] bool -> [B, R, d], computed as
    transformers' eager attention does (scale, softcap, mask, fp32 softmax)."""
    scores = torch.bmm(query, keys.transpose(1, 2)) * window.scale
    if window.softcap is not None:
        scores = torch.tanh(scores / window.softcap) * window.softcap
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.bmm(probs, values)


def _visible(query_pos: torch.Tensor, key_pos: torch.Tensor, window: Window) -> torch.Tensor:
    """[R, L] bool: causal, and inside the sliding window where there is one."""
    allowed = key_pos[None, :] <= query_pos[:, None]
    if window.sliding_window is not None:
        allowed &= key_pos[None, :] > query_pos[:, None] - window.sliding_window
    return allowed


def _decode_groups(meta: AttentionMetadata) -> Iterator[tuple[int, int, torch.Tensor]]:
    """(first row, count, page table [count, max_pages]) of each run of decodes."""
    if meta.kernel_decodes is not None:
        yield 0, meta.kernel_decodes.count, meta.kernel_decodes.page_table
    for bucket in meta.decode_buckets:
        yield bucket.start, bucket.count, bucket.page_table


def masked_paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    ctx: PagedContext,
    window: Window,
) -> torch.Tensor:
    """Paged attention with a sliding window and/or softcapping; the layout of paged_attention."""
    meta, positions = ctx.meta, ctx.positions
    assert meta is not None
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[0]
    group = num_heads // kv_heads
    out = torch.empty_like(q)
    for start, count, table in _decode_groups(meta):
        rows = slice(start, start + count)
        table = table.to(q.device)
        keys = gather_pages(k_cache, table, q.dtype)  # [kv_heads * b, max_len, head_dim]
        values = gather_pages(v_cache, table, q.dtype)
        key_pos = torch.arange(keys.shape[1], device=q.device)
        allowed = _visible(positions[rows], key_pos, window).repeat(kv_heads, 1)[:, None, :]
        # Head h reads kv head h // group: query rows [kv_heads * b, group, head_dim].
        query = q[rows].view(count, kv_heads, group, head_dim).transpose(0, 1)
        result = _attend(query.reshape(-1, group, head_dim), keys, values, allowed, window)
        out[rows] = result.view(kv_heads, count, group, head_dim).transpose(0, 1).flatten(1, 2)
    for chunk in meta.every_prefill(k_cache.shape[2]):
        rows = slice(chunk.start, chunk.start + chunk.num_tokens)
        n = chunk.num_tokens
        if chunk.pages is None:
            keys = as_stored(k[rows], k_cache).transpose(0, 1)  # [kv, n, d]
            values = as_stored(v[rows], v_cache).transpose(0, 1)
            key_pos = positions[rows]
        else:
            context_len = chunk.start_pos + n
            keys = gather_pages(k_cache, chunk.pages, q.dtype)[:, :context_len]
            values = gather_pages(v_cache, chunk.pages, q.dtype)[:, :context_len]
            key_pos = torch.arange(context_len, device=q.device)
        allowed = _visible(positions[rows], key_pos, window)  # [n, L]
        allowed = allowed.repeat(group, 1)[None]  # rows (g, i) of each kv head: [1, group*n, L]
        # [n, heads, d] -> [kv_heads, group * n, d], the heads of one kv head together
        query = q[rows].transpose(0, 1).reshape(kv_heads, group * n, head_dim)
        result = _attend(query, keys, values, allowed.expand(kv_heads, -1, -1), window)
        out[rows] = result.view(num_heads, n, head_dim).transpose(0, 1)
    return out
