"""The Llama family on the paged KV cache: Llama 2/3 (with llama3 rope scaling), SmolLM2, Mistral
without sliding window, Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm).

Tokens of all sequences in a step are packed into one row dimension, so every linear layer runs once
per step over the whole batch; only attention looks at sequence boundaries (see attention.py).
q/k/v and gate/up projections are fused into one matmul each when loading Hugging Face weights.
On CPU the elementwise work runs in fused C kernels where they build (``use_fused_ops``): the
residual add with the next RMSNorm, rotary in place on the qkv output, SiLU-and-multiply; a
decode step's rotary and K/V write go into its attention call (``decode_step_attention``), and a
decode step of a few streams runs every layer in one C call (models/decode_loop.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from yaied.kernels.cpu_decode_loop import CpuDecodeLoop
from yaied.kernels.cpu_fused import CpuFusedOps
from yaied.worker.attention import (
    AttentionMetadata,
    decode_step_attention,
    paged_attention,
    store_kv,
)
from yaied.worker.models.decode_loop import LlamaDecodeLoop

if TYPE_CHECKING:  # imports triton: only the GPU path builds one
    from yaied.kernels.triton_fused import TritonFusedOps

    FusedOps = CpuFusedOps | TritonFusedOps


@dataclass(frozen=True, slots=True)
class LlamaShape:
    """The architecture knobs read from a Hugging Face config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    mlp_bias: bool

    @classmethod
    def from_hf_config(cls, config) -> LlamaShape:
        model_type = config.model_type
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
            qk_norm=model_type == "qwen3",
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
        )


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and scale in the model dtype, as the reference implementation does;
        # F.rms_norm fuses the fp32 part (about 6x faster than spelling it out on CPU).
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return self.weight * normed.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = shape.num_heads, shape.num_kv_heads
        self.head_dim = shape.head_dim
        self.q_size = shape.num_heads * shape.head_dim
        self.kv_size = shape.num_kv_heads * shape.head_dim
        self.qkv_proj = nn.Linear(
            shape.hidden_size, self.q_size + 2 * self.kv_size, bias=shape.qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, shape.hidden_size, bias=False)
        self.q_norm = RMSNorm(shape.head_dim, shape.rms_norm_eps) if shape.qk_norm else None
        self.k_norm = RMSNorm(shape.head_dim, shape.rms_norm_eps) if shape.qk_norm else None
        self.scale = shape.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        ops: FusedOps | None = None,
    ) -> torch.Tensor:
        # x: [num_tokens, hidden]; cos, sin: [num_tokens, 1, head_dim], or with ops
        # [num_tokens, head_dim / 2] fp32
        qkv = self.qkv_proj.forward(x)  # .forward: no hooks here, and __call__ costs per layer
        return self.attend(qkv, cos, sin, kv_cache, meta, ops)

    def attend(self, qkv, cos, sin, kv_cache, meta, ops: FusedOps | None) -> torch.Tensor:
        """The layer after the q/k/v projection: qkv [num_tokens, (heads + 2 kv_heads) * dim]."""
        n = qkv.shape[0]
        if ops is not None and self.q_norm is None:
            out = decode_step_attention(qkv, self.num_heads, cos, sin, kv_cache, meta, self.scale)
            if out is not None:  # decodes only: rotary, K/V write and attention in one call
                return self.o_proj.forward(out)
            ops.rotary(qkv, self.num_heads + self.num_kv_heads, cos, sin)  # q and k, in place
        elif ops is not None:  # Qwen3: q and k normalised per head, then rotated, in place
            ops.qk_norm_rotary(
                qkv, self.num_heads, self.num_kv_heads, self.q_norm.weight, self.k_norm.weight,
                self.q_norm.eps, cos, sin,
            )  # fmt: skip
        # [n, heads + 2 * kv_heads, head_dim]: q, k and v as views, in one op each
        heads = qkv.view(n, -1, self.head_dim)
        q = heads[:, : self.num_heads]
        k = heads[:, self.num_heads : self.num_heads + self.num_kv_heads]
        v = heads[:, self.num_heads + self.num_kv_heads :]
        if ops is None:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
        k_cache, v_cache = kv_cache
        store_kv(k_cache, v_cache, k, v, meta)
        out = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
        return self.o_proj.forward(out.reshape(n, self.q_size))


class MLP(nn.Module):
    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.intermediate = shape.intermediate_size
        self.gate_up_proj = nn.Linear(shape.hidden_size, 2 * self.intermediate, bias=shape.mlp_bias)
        self.down_proj = nn.Linear(self.intermediate, shape.hidden_size, bias=shape.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (with the fused kernels DecoderLayer.forward_fused runs the MLP itself)
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.self_attn = Attention(shape)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.mlp = MLP(shape)

    def forward(self, x, cos, sin, kv_cache, meta) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(self, x, delta, cos, sin, kv_cache, meta, ops: FusedOps):
        """The same layer with the residual adds folded into the norms: x is the residual
        stream without the previous layer's output ``delta`` (None for the first layer); x is
        updated in place. Returns (x, this layer's output, not yet added)."""
        norm, attn, mlp = self.input_layernorm, self.self_attn, self.mlp
        qkv = attn.qkv_proj.forward(ops.add_rms_norm(delta, x, norm.weight, norm.eps))
        out = attn.attend(qkv, cos, sin, kv_cache, meta, ops)
        norm = self.post_attention_layernorm
        gate_up = mlp.gate_up_proj.forward(ops.add_rms_norm(out, x, norm.weight, norm.eps))
        return x, mlp.down_proj.forward(ops.silu_mul(gate_up))


class LlamaForCausalLM(nn.Module):
    # Hugging Face weight name -> (our fused parameter, shard index); shards are stacked on dim 0.
    FUSED = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, shape: LlamaShape, inv_freq: torch.Tensor, rope_scaling: float) -> None:
        super().__init__()
        self.shape = shape
        # Built on the meta device (build_model): an Embedding's own normal_ init on meta runs
        # torch's Python reference, which imports torch._dynamo and with it triton, 0.6 s and
        # about 100 MB resident that a CPU daemon never uses. Its weight is loaded anyway.
        empty = torch.empty(shape.vocab_size, shape.hidden_size)
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size, _weight=empty)
        self.layers = nn.ModuleList(DecoderLayer(shape) for _ in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        self.tie_weights()
        # fp32 rotary frequencies; cos/sin are built per step for the positions in it.
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.rope_scaling = rope_scaling
        self.fused_ops: FusedOps | None = None
        self.decode_loop: LlamaDecodeLoop | None = None

    def use_fused_ops(self, ops: FusedOps | None) -> bool:
        """Run the elementwise work through ops from now on (CpuFusedOps or TritonFusedOps,
        for weights on their device type and of a dtype they support); returns whether they
        are used."""
        weight = self.embed_tokens.weight
        usable = (
            ops is not None and weight.device.type == ops.device_type and ops.supports(weight.dtype)
        )
        self.fused_ops = ops if usable else None
        return usable

    def use_decode_loop(self, loop: CpuDecodeLoop | None) -> bool:
        """Run decode steps of a few rows through ``loop`` where every layer fits it (after
        use_fused_ops and the linears' packing); returns whether it is used."""
        fits = loop is not None and self.fused_ops is not None and LlamaDecodeLoop.fits(self, loop)
        self.decode_loop = LlamaDecodeLoop(self, loop) if fits else None
        return fits

    def tie_weights(self) -> None:
        if self.shape.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [num_tokens, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.rope_scaling).to(dtype)
        sin = (emb.sin() * self.rope_scaling).to(dtype)
        return cos.unsqueeze(1), sin.unsqueeze(1)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens]. Returns hidden states [num_tokens, hidden]."""
        x = self.embed_tokens(input_ids)
        ops = self.fused_ops
        if ops is not None:
            freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [num_tokens, dim / 2]
            cos, sin = freqs.cos() * self.rope_scaling, freqs.sin() * self.rope_scaling
            loop = self.decode_loop  # a decode step of a few rows: every layer in one C call
            delta = None if loop is None else loop(x, cos, sin, kv_caches, meta)
            if delta is None:
                for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                    x, delta = layer.forward_fused(x, delta, cos, sin, kv_cache, meta, ops)
            return ops.add_rms_norm(delta, x, self.norm.weight, self.norm.eps)
        cos, sin = self.rotary(positions, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv_cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()  # [rows, vocab], fp32 for the sampler

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], absent: Iterable[str] = ()
    ) -> None:
        """Copy ``weights`` in. ``absent``: checkpoint names left out of ``weights`` on purpose
        (projections that quantized blocks replace next), counted as loaded, never written."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        named: Iterable[tuple[str, torch.Tensor | None]] = weights
        for hf_name, tensor in itertools.chain(named, ((n, None) for n in absent)):
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.shape.tie_word_embeddings:
                continue
            parts = name.split(".")
            fused = next((p for p in parts if p in self.FUSED), None)
            if fused is None:
                if tensor is not None:
                    self._copy(params, name, tensor)
                loaded.add(name)
                continue
            target, shard = self.FUSED[fused]
            name = name.replace(fused, target)
            param = params.get(name)
            if param is None:
                raise ValueError(f"unexpected weight {hf_name}")
            offset, size = self._shard_range(target, shard)
            rows = param.data[offset : offset + size]
            if tensor is None:
                loaded.add(f"{name}#{shard}")
                continue
            if rows.shape != tensor.shape:  # copy_ would broadcast a [rows, 1] without a word
                raise ValueError(
                    f"weight {hf_name}: shape {tuple(tensor.shape)} != {tuple(rows.shape)}"
                )
            rows.copy_(tensor)
            loaded.add(f"{name}#{shard}")
        self._check_complete(params, loaded)

    def _shard_range(self, target: str, shard: int) -> tuple[int, int]:
        s = self.shape
        if target == "gate_up_proj":
            return shard * s.intermediate_size, s.intermediate_size
        q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        return [(0, q), (q, kv), (q + kv, kv)][shard]

    @staticmethod
    def _copy(params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> None:
        param = params.get(name)
        if param is None:
            raise ValueError(f"unexpected weight {name}")
        if param.shape != tensor.shape:
            raise ValueError(f"weight {name}: shape {tuple(tensor.shape)} != {tuple(param.shape)}")
        param.data.copy_(tensor)

    def _check_complete(self, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        missing = []
        for name in params:
            if name == "lm_head.weight" and self.shape.tie_word_embeddings:
                continue
            shards = 3 if "qkv_proj" in name else 2 if "gate_up_proj" in name else 0
            want = [f"{name}#{i}" for i in range(shards)] if shards else [name]
            missing += [w for w in want if w not in loaded]
        if missing:
            raise ValueError(f"checkpoint lacks weights: {', '.join(missing[:8])}")
