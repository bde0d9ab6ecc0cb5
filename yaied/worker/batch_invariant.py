"""engine.batch_invariant: a row computes the same bits whatever else shares its step.

By default a row's numbers depend a little on its company. oneDNN picks its matmul blocking by
the number of rows, so a prompt prefilled beside another, or cut elsewhere by the step budget,
differs in the last bit of some outputs; a decode row runs the decode loop in a step of up to
eight decodes and the layer path in a bigger or mixed one; a lone prompt token runs as a decode
row. Over 30 layers a last bit now and then flips a near-tie: of 60 greedy calls of 24 tokens
sent to the default model at once (bf16), 28 answered otherwise than the same request alone.
vLLM (VLLM_BATCH_INVARIANT) and SGLang (--enable-deterministic-inference) offer the same
guarantee as an option.

With the option (CPU only):

- every linear layer runs the few-row kernel, MAX_ROWS rows a call, whose rows are the same
  bits in any slice (cpu_gemv.c, cpu_quant.c): the LM head and prompt chunks included;
- a step runs as groups: its decodes of output tokens MAX_ROWS at a time (each group the step
  a few decodes alone would be: the decode loop, or the layers over the decode step kernel),
  then every prompt chunk together on the layer path;
- a lone prompt token is a one-token chunk (TorchBatchPacker.lone_prompt_tokens_prefill): the
  prefill attention kernel gives a position the same bits however its prompt was cut.

What is left is per row already: the fused norms, rotary and SiLU kernels, the attention
kernels, the sampler (a seeded draw keys on the seed and the position). Prompts prefill slower:
the few-row kernel reads the weights once per MAX_ROWS rows (docs/benchmarks.md has the cost).
Not covered: a preempted request recomputes its output tokens as prompt (other kernels); the GPU
path, speculative decoding and tensor parallelism refuse the option.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from yaied.core.config import EngineConfig
from yaied.core.step import ScheduledSeq
from yaied.kernels.cpu_gemv import MAX_ROWS
from yaied.worker.torch_packing import TorchBatchPacker


def check_device(config: EngineConfig, device: torch.device) -> None:
    """Raise ValueError (one line) where engine.batch_invariant asks for a device it has no
    path for (EngineConfig itself refuses speculative decoding and tensor parallelism)."""
    if config.engine.batch_invariant and device.type != "cpu":
        raise ValueError("engine.batch_invariant runs on CPU only (device.device = cpu)")


def use_few_rows_everywhere(model: nn.Module) -> None:
    """Every linear layer takes its few-row kernel for any number of rows, in slices."""
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
    if missing:
        raise ValueError(
            "engine.batch_invariant needs the CPU few-row kernel on every linear layer; "
            f"{missing[0]} has none (no C compiler, fp32 weights, or its weight copy does not "
            "fit in memory)"
        )


def check_kernels(runner) -> None:
    """The attention kernels the guarantee rests on (a ModelRunner's; the torch paths pad
    and gather by the batch)."""
    if runner.decode_kernel is None or runner.prefill_kernel is None:
        raise ValueError(
            "engine.batch_invariant needs the CPU attention kernels, which did not build here "
            "(a C compiler with OpenMP; this model's head size and grouping)"
        )


def forward_in_groups(
    model: nn.Module,
    packer: TorchBatchPacker,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    seqs: list[ScheduledSeq],
) -> tuple[torch.Tensor, torch.Tensor, dict[str, int]]:
    """ModelRunner._forward's result for a step run as groups (decodes MAX_ROWS at a time,
    then the chunks): hidden states of every row, the sampled rows in batch order, and each
    request's first row."""
    decodes = [s for s in seqs if packer.is_decode(s)]
    chunks = [s for s in seqs if not packer.is_decode(s)]
    groups = [decodes[i : i + MAX_ROWS] for i in range(0, len(decodes), MAX_ROWS)]
    if chunks:
        groups.append(chunks)
    parts: list[torch.Tensor] = []
    first_row: dict[str, int] = {}
    offset = 0
    for group in groups:
        prepared = packer.build(group)
        parts.append(model(prepared.input_ids, prepared.positions, kv_caches, prepared.meta))
        for request_id, row in prepared.first_row.items():
            first_row[request_id] = offset + row
        offset += parts[-1].shape[0]
    hidden = parts[0] if len(parts) == 1 else torch.cat(parts)
    sampled = [first_row[s.request_id] + len(s.token_ids) - 1 for s in seqs if s.sample]
    return hidden, torch.tensor(sampled, dtype=torch.int64), first_row
