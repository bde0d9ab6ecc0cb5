"""A Llama-family model's decode step as one C call (kernels/cpu_decode_loop.c).

Where it applies (on CPU, bf16 math or fp32 math over bf16 weights with the few-row linear
kernel on every projection, or fp32 weights with only the panel matmul's copy on every
projection; the fused elementwise kernels, no q/k norm), ``LlamaForCausalLM.forward`` hands a
decode-only step of up to ``max_rows()`` rows (MAX_ROWS, or AMX_MAX_ROWS where bf16 layers run
on AMX tiles; any number where every projection has the panel matmul's copy, which then takes
the steps past MAX_ROWS, or every step for fp32 weights), each decoding an output token, to
``LlamaDecodeLoop`` instead of running the layers from Python: about 1.2 ms of Python calls a
step at batch 1. Its linear layers are the few-row kernel (or the panels), which accumulates in
another order than oneDNN (the last bf16 bit differs in about one output in ten thousand): a
prompt token always takes the layer path, so that a prompt computes the same whether its prefix
was cached or not.
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
        # The few-row kernel's entry where every projection has one (fits); fp32 weights have
        # only panels (PanelLinear, yaied/worker/cpu_linear.py), which then run every step.
        self._bound = getattr(attn.qkv_proj, "few_rows", None)
        # Past the few-row kernel's rows: the panel matmul's entry, where every projection has
        # panels (fp32 math from avx2 up: yaied/worker/cpu_linear.py), else the layer path
        linears = [m for layer in model.layers for m in _projections(layer)]
        panels = all(getattr(m, "panels", None) is not None for m in linears)
        self._panels = linears[0].panels.address if panels else None
        self.linear = self._panels if self._bound is None else self._bound.address
        # the pointer tables, few-row and panels: (pools' address, the pointers) each
        self._layers: dict[bool, tuple[int, ctypes.Array]] = {}

    @classmethod
    def fits(cls, model: nn.Module, loop: CpuDecodeLoop) -> bool:
        """Whether every layer can run in the loop: no q/k norm, and on all four projections
        either the few-row kernel bound for the model's activations or (fp32 weights) only
        the panel matmul's copy."""
        dtype = model.embed_tokens.weight.dtype
        if not loop.supports(dtype):
            return False
        addresses = set()
        for layer in model.layers:
            if layer.self_attn.q_norm is not None:
                return False
            for m in _projections(layer):
                few_rows = getattr(m, "few_rows", None)
                if few_rows is not None and few_rows.dtype == dtype:
                    addresses.add(few_rows.address)
                elif few_rows is None and getattr(m, "panels", None) is not None:
                    addresses.add(("panels", m.panels.address))
                else:
                    return False
        # One kernel entry for every projection: all bf16, all quantized (whatever types), or
        # all panels
        return len(addresses) == 1

    def max_rows(self) -> int:
        """The most rows a step may have to run here: the few-row kernel's, or any number
        with the panels."""
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
        # the panels past the few-row kernel's rows (always for fp32 weights), else that
        # kernel, as alone
        panels = self._bound is None or rows > self._bound.max_rows
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
