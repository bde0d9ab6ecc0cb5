"""Start-up decisions of the GPU path: which attention backend runs, how large a step can get,
and how many KV pages fit in what the device has left after a warm-up pass.

The sizing rule (vLLM's): the engine may use `utilization` of the device's total memory. From
that share come what other processes and the CUDA context already hold, the memory our own
tensors peaked at during the largest step the scheduler can build (weights plus activations,
measured with a small temporary KV pool), and a reserve for the CUDA graphs' private pool. The
rest is the KV pool.
"""

from __future__ import annotations

import os

from yaied.core.request import SamplingParams
from yaied.core.step import ScheduledSeq

GRAPH_RESERVE_BYTES = 512 * 2**20  # decode graphs' private pool: activations of <= 512 rows


def resolve_attention_backend(name: str, device_type: str, native: bool = True) -> str:
    """'triton' or 'torch' (the torch path, with the C decode kernel on CPU). Models run through
    transformers' classes (`native` False) attend only on the torch path: their attention
    (hf_attention.py) writes K/V by int64 slots and runs windows and softcaps of its own, and
    their forward reads the step's largest position on the host, which a CUDA graph cannot."""
    if name == "auto":
        return "triton" if device_type == "cuda" and native else "torch"
    if name not in ("triton", "torch"):
        raise ValueError(f"device.attention_backend must be auto, triton or torch, got {name!r}")
    if name == "triton" and not native:
        raise ValueError(
            "attention_backend=triton serves native models only; this model runs through "
            "transformers' classes: use attention_backend=auto or torch"
        )
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if name == "triton" and device_type == "cpu" and not interpreted:
        raise ValueError(
            "attention_backend=triton on CPU runs in Triton's interpreter (slow, for tests): "
            "set TRITON_INTERPRET=1 before starting"
        )
    return name


def warmup_seqs(max_tokens: int, max_seqs: int, page_size: int) -> tuple[list[ScheduledSeq], int]:
    """The largest step the scheduler can build, and the pages it needs: max_seqs sequences
    sharing max_tokens tokens (max_seqs - 1 decodes and one prefill chunk with the rest), every
    one sampling with top-p (the sampler's largest temporaries)."""
    if max_tokens < 1 or max_seqs < 1 or page_size < 1:
        raise ValueError("max_tokens, max_seqs and page_size must be >= 1")
    num_decodes = min(max_seqs, max_tokens) - 1
    chunk_len = max_tokens - num_decodes
    params = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.9)
    chunk_pages = list(range(-(-chunk_len // page_size)))
    seqs = [ScheduledSeq("warmup-chunk", [1] * chunk_len, 0, chunk_pages, True, params)]
    next_page = len(chunk_pages)
    for i in range(num_decodes):
        seqs.append(ScheduledSeq(f"warmup-{i}", [1], 0, [next_page + i], True, params))
    return seqs, next_page + num_decodes


def kv_cache_bytes(
    *,
    total: int,
    free: int,
    torch_reserved: int,
    torch_peak: int,
    utilization: float,
    graph_reserve: int = 0,
) -> int:
    """Bytes the KV pool may take. `free` and `torch_reserved` are read after the warm-up, with
    its temporary pool released; `torch_peak` is our tensors' peak during it, less that pool."""
    others = max(total - free - torch_reserved, 0)  # CUDA context, other processes
    budget = int(total * utilization) - others - torch_peak - graph_reserve
    if budget <= 0:
        gib = 2**30
        raise ValueError(
            f"no GPU memory left for the KV cache: {total / gib:.1f} GiB x utilization "
            f"{utilization} leaves nothing after {others / gib:.1f} GiB held elsewhere and a "
            f"{torch_peak / gib:.1f} GiB peak for weights and activations; raise "
            "cache.gpu_memory_utilization or lower scheduler.max_num_batched_tokens"
        )
    return budget
