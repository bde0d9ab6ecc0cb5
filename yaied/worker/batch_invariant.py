"""engine.batch_invariant: a token computes the same bits whatever shares its step.

By default a row's numbers depend a little on its company. oneDNN picks its matmul blocking by
the number of rows, so a prompt prefilled beside another, or cut elsewhere by the step budget,
differs in the last bit of some outputs; a decode row runs the decode loop in a step of up to
eight decodes and the layer path in a bigger or mixed one, and the decode attention kernel adds
in another order than the prefill kernel. Over 30 layers a last bit now and then flips a
near-tie: of 60 greedy calls of 24 tokens sent to the default model at once (bf16), 28 answered
otherwise than the same request alone. vLLM (VLLM_BATCH_INVARIANT) and SGLang
(--enable-deterministic-inference) offer the same guarantee as an option.

With the option (CPU only) every token takes the prefill path, a decode as a one-token chunk
(TorchBatchPacker.every_token_prefill):

- every linear layer runs the few-row kernel, MAX_ROWS rows a call, whose rows are the same
  bits in any slice (cpu_gemv.c, cpu_quant.c): the LM head included; fp32 weights (a forced
  float32) the panel matmul, whose rows are too (cpu_matmul.c, from avx2 up);
- attention is the prefill kernel's, which gives a position the same bits however its
  sequence was cut into chunks (a step's one-token chunks in one call: its ``chunks`` entry);
  the fused norm, rotary and SiLU kernels and the sampler (a seeded draw keys on the seed and
  the position) work row by row.

So a token's K/V are the same bits whether it was a prompt token or an output, computed in one
chunk or another, alone or in a crowd: a later turn that finds an answer in the prefix cache,
and a preempted request that recomputes its output as prompt, go on from the same numbers as a
fresh one. The price: prompts prefill slower (eight rows a call against oneDNN's matmul), and
decodes run the layers from Python (no decode loop) and the prefill kernel; docs/benchmarks.md
has the figures. The GPU path, speculative decoding and tensor parallelism refuse the option.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from yaied.core.config import EngineConfig


def check_device(config: EngineConfig, device: torch.device) -> None:
    """Raise ValueError (one line) where engine.batch_invariant asks for a device it has no
    path for (EngineConfig itself refuses speculative decoding and tensor parallelism)."""
    if config.engine.batch_invariant and device.type != "cpu":
        raise ValueError("engine.batch_invariant runs on CPU only (device.device = cpu)")


def use_few_rows_everywhere(model: nn.Module) -> None:
    """Every linear layer takes its few-row kernel for any number of rows, in slices. fp32
    weights have no few-row kernel; their panel matmul (PanelLinear, from avx2 up) gives a row
    the same bits in any batch already, so it stays."""
    missing = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):  # neither packed nor quantized: no kernel bound
            missing.append(name)
        if not hasattr(module, "few_rows_in_forward"):
            continue
        if module.few_rows is None:
            missing.append(name)
            continue
        module.few_rows_in_forward = True
        module.sliced_max_rows = sys.maxsize
        if hasattr(module, "drop_matmul_weights"):  # oneDNN's packed copy, an fp32 one
            module.drop_matmul_weights()
    if missing:
        raise ValueError(
            "engine.batch_invariant needs the CPU few-row kernel (or, for fp32 weights, the "
            f"panel matmul) on every linear layer; {missing[0]} has none (no C compiler, fp32 "
            "weights below avx2, or its weight copy does not fit in memory)"
        )


def check_kernels(runner) -> None:
    """The kernels the guarantee rests on besides the linears' (a ModelRunner's): the prefill
    attention kernel and the fused elementwise ones (the torch paths pad and gather by the
    batch)."""
    if runner.prefill_kernel is None or getattr(runner.model, "fused_ops", None) is None:
        raise ValueError(
            "engine.batch_invariant needs the CPU attention and elementwise kernels, which did "
            "not build here (a C compiler with OpenMP; this model's head size and grouping)"
        )
