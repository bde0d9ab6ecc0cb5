"""A Llama-family model's decode step as one C call (kernels/cpu_decode_loop.c).

Where it applies (on CPU, bf16 math or fp32 math over bf16 weights, the few-row linear kernel
on every projection, the fused elementwise kernels, no q/k norm), ``LlamaForCausalLM.forward``
hands a decode-only step of up to ``max_rows()`` rows (MAX_ROWS, or AMX_MAX_ROWS where bf16
layers run on AMX tiles; any number where every projection has the panel matmul's copy, which
then takes the steps past MAX_ROWS), each decoding an output token, to ``LlamaDecodeLoop``
instead of running the layers from Python: about 1.2 ms of Python calls a step at batch 1.
Its linear layers are the few-row kernel, which accumulates in another order than oneDNN (the
last bf16 bit differs in about one output in ten thousand): a prompt token always takes the
layer path, so that a prompt computes the same whether its prefix was cached or not.
"""

from __future__ import annotations

import ctypes
import sys

import torch
from torch import nn

from yaied.kernels.cpu_decode_loop import CpuDecodeLoop, DecodeShape, LayerTensors
from yaied.worker.attention import AttentionMetadata


class LlamaDecodeLoop:
    """Bound to one LlamaForCausalLM (models/llama.py; typed nn.Module here, which llama.py
    imports)."""

    def __init__(self, model: nn.Module, loop: CpuDecodeLoop) -> None:
        self.model = model
        self.loop = loop
        shape = model.shape
        attn = model.layers[0].self_attn
        self.shape = DecodeShape(
            shape.hidden_size,
            shape.intermediate_size,
            shape.num_heads,
            shape.num_kv_heads,
            shape.head_dim,
            shape.rms_norm_eps,
            attn.scale,
        )
        self.dtype = model.embed_tokens.weight.dtype  # the activations'
        self.linear = attn.qkv_proj.few_rows.address
        self._bound = attn.qkv_proj.few_rows  # every projection has its kernel entry (fits)
        # Past the few-row kernel's rows: the panel matmul's entry, where every projection has
        # panels (fp32 math from avx2 up: yaied/worker/cpu_linear.py), else the layer path
        linears = [m for layer in model.layers for m in _projections(layer)]
        panels = all(getattr(m, "panels", None) is not None for m in linears)
        self._panels = linears[0].panels.address if panels else None
        # the pointer tables, few-row and panels: (pools' address, the pointers) each
        self._layers: dict[bool, tuple[int, ctypes.Array]] = {}

    @classmethod
    def fits(cls, model: nn.Module, loop: CpuDecodeLoop) -> bool:
        """Whether every layer can run in the loop: the few-row kernel bound on all four
        projections for the model's activations, and no q/k norm."""
        dtype = model.embed_tokens.weight.dtype
        if not loop.supports(dtype):
            return False
        addresses = set()
        for layer in model.layers:
            linears = _projections(layer)
            if layer.self_attn.q_norm is not None or any(
                getattr(getattr(m, "few_rows", None), "dtype", None) != dtype for m in linears
            ):
                return False
            addresses.update(m.few_rows.address for m in linears)
        # One kernel entry for every projection: all bf16, or all quantized (whatever types)
        return len(addresses) == 1

    def max_rows(self) -> int:
        """The most rows a step may have to run here: the few-row kernel's (now), or any
        number with the panels."""
        return sys.maxsize if self._panels is not None else self._bound.max_rows

    def __call__(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor | None:
        """The last layer's output (x, the residual stream, updated in place), or None where
        the step is not a few decodes on the decode kernel: the caller runs the layers."""
        fused = meta.kernel_decodes
        rows = x.shape[0]
        if fused is None or fused.count != rows or not 0 < rows <= self.max_rows():
            return None
        if not fused.output_decodes:  # a prompt token: the layer path, as in a prefill
            return None
        k_cache = kv_caches[0][0]
        if not self.loop.supports(self.dtype, k_cache.dtype):
            return None
        panels = rows > self._bound.max_rows  # else the few-row kernel, as alone
        return self.loop(
            self._panels if panels else self.linear,
            fused.kernel.step_address(self.dtype, k_cache.dtype),
            self._layer_pointers(kv_caches, panels),
            self.shape,
            x,
            cos,
            sin,
            meta.slot_mapping,
            fused.page_table,
            fused.context_lens,
            k_cache.shape[1],
            k_cache.shape[2],
            k_cache.dtype,
        )

    def _layer_pointers(
        self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], panels: bool
    ) -> ctypes.Array:
        """Built once for either kind of weight, again only if the KV pools were allocated
        anew."""
        weight = _panels if panels else _weight
        key = kv_caches[0][0].data_ptr()
        if panels not in self._layers or self._layers[panels][0] != key:
            tensors = []
            for layer, (k_cache, v_cache) in zip(self.model.layers, kv_caches, strict=True):
                attn, mlp = layer.self_attn, layer.mlp
                tensors.append(
                    LayerTensors(
                        layer.input_layernorm.weight.detach(),
                        layer.post_attention_layernorm.weight.detach(),
                        weight(attn.qkv_proj),
                        attn.qkv_proj.bias,
                        weight(attn.o_proj),
                        attn.o_proj.bias,
                        weight(mlp.gate_up_proj),
                        mlp.gate_up_proj.bias,
                        weight(mlp.down_proj),
                        mlp.down_proj.bias,
                        k_cache,
                        v_cache,
                    )
                )
            self._layers[panels] = (key, self.loop.layers(tensors, self.dtype))
        return self._layers[panels][1]


def _projections(layer: nn.Module) -> tuple[nn.Module, ...]:
    """A decoder layer's four projections."""
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


def _panels(linear: nn.Module) -> torch.Tensor:
    """The panel matmul's copy of the layer's weight (cpu_matmul.py)."""
    return linear.panels.panels


def _weight(linear: nn.Module) -> torch.Tensor:
    """What the few-row kernel takes as the layer's weight: the bf16 weight in its streaming
    layout, or a quantized layer's descriptor (kernels/cpu_gemv.py, kernels/cpu_quant.py)."""
    return linear.few_rows.kernel_weight
