"""A loaded model made ready for the CPU kernels, before its KV pool is sized: the worker's
step between loading and the runner (yaied/worker/worker.py).

The linear layers go by the CPU's math (worker/cpu_linear.py): bf16 packed for oneDNN where the
CPU has bf16 dot products; fp32 over bf16-stored weights under dtype auto elsewhere, with a
decode loop over the few-row kernel either way; fp32 weights (a forced float32) on the panel
matmul. Quantized projections keep their blocks (worker/quantized.py). A native Llama-family
model then takes the fused elementwise kernels and the one-call decode loop.
"""

from __future__ import annotations

import torch

from yaied.core.config import EngineConfig
from yaied.kernels.cpu_decode_loop import CpuDecodeLoop
from yaied.kernels.cpu_fused import CpuFusedOps
from yaied.kernels.cpu_gemv import CpuGemv
from yaied.kernels.cpu_matmul import CpuMatmul
from yaied.kernels.cpu_quant import CpuQuant
from yaied.worker.batch_invariant import use_few_rows_everywhere
from yaied.worker.cpu_linear import (
    can_pack,
    gemv_fits,
    pack_linears,
    store_linears_bf16,
    store_linears_panels,
)
from yaied.worker.host_memory import return_freed_memory
from yaied.worker.loader import LoadedModel
from yaied.worker.models.llama import LlamaForCausalLM
from yaied.worker.quantized import bind_quantized


def prepare_cpu_model(
    loaded: LoadedModel, config: EngineConfig, level: str, batch_hint: int
) -> list:
    """Swap in the CPU kernels at ISA ``level``; returns the kernels the model uses (None
    where one did not build), whose lowest level the worker reports."""
    model, dtype = loaded.model, loaded.dtype
    kernels: list = []
    if loaded.quantization != "none":  # the projections; the LM head goes on below
        quant = CpuQuant.load(level)
        bind_quantized(model, quant, dtype)
        if quant is not None:
            kernels.append(quant)
    if dtype == torch.float32 and loaded.weight_dtype == torch.bfloat16:
        # The panel matmul's fp32 copies (a tied head's too) would undo what quantized
        # projections save in memory: those keep their own path for many rows.
        quantized = loaded.quantization != "none"
        gemv, matmul = CpuGemv.load(level), None if quantized else CpuMatmul.load(level)
        kernels += [gemv, matmul if matmul is not None and matmul.fast else None]
        store_linears_bf16(model, gemv, batch_hint, matmul)
    elif dtype == torch.float32 and loaded.quantization == "none":
        # fp32 weights (a forced --dtype float32): the panel matmul for every row count, where
        # it is fast at this level; else F.linear
        matmul = CpuMatmul.load(level)
        if matmul is not None and store_linears_panels(model, matmul):
            kernels.append(matmul)
    elif dtype == torch.bfloat16:
        pack = can_pack(dtype, torch.device("cpu"), level)
        # The kernel reads its own copy of the weights, in its streaming layout.
        kernels.append(CpuGemv.load(level) if gemv_fits(model) else None)
        pack_linears(model, batch_hint, kernels[-1], pack)
    if isinstance(model, LlamaForCausalLM):
        fused = CpuFusedOps.load(level)
        if model.use_fused_ops(fused):
            kernels.append(fused)
        # engine.batch_invariant runs decodes on the prefill path: no decode loop, nor its
        # build at start-up
        if not config.engine.batch_invariant:
            loop = CpuDecodeLoop.load(level)
            if model.use_decode_loop(loop):
                kernels.append(loop)
    if config.engine.batch_invariant:
        use_few_rows_everywhere(model)
    # The weights the packed, panel or bf16-stored copies replaced, and packing's scratch: left
    # in the heap, resident for the engine's life (146 MB of the default model's bf16 packing).
    return_freed_memory()
    return kernels
