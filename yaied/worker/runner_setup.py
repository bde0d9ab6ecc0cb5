"""Building a model's KV pools, runner and CUDA graphs: the worker's steps after loading, shared
with the tensor-parallel ranks (yaied/worker/parallel/rank.py), which build theirs the same way
when rank 0 tells them to."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from yaied.core.config import EngineConfig
from yaied.worker import host_memory
from yaied.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from yaied.worker.cuda_graphs import DecodeGraphs

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]
_KV_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def resolve_kv_dtype(
    name: str,
    dtype: torch.dtype,
    device: torch.device,
    backend: str = "torch",
    weight_dtype: torch.dtype | None = None,
) -> torch.dtype:
    """The KV pools' dtype for ``cache.kv_cache_dtype`` under math ``dtype``. bfloat16 pools
    under float32 math (on CPU, where the attention kernels widen them as they read) hold half
    the bytes, so a decode step reads half and the pool twice the tokens; each K/V row is
    rounded once, when it is written (on the default model: 0.0001 nats/token of a held-out
    text, docs/benchmarks.md). ``auto`` takes them where the weights are bf16 under fp32 math
    (dtype auto on a CPU without bf16 math: W-mixed 4% faster at the avx2 level), else the
    math's dtype: a forced ``--dtype float32`` keeps fp32 pools. Other pairings are refused."""
    if name == "auto":
        on_cpu_kernels = device.type == "cpu" and backend != "triton"
        bf16_weights_fp32_math = (dtype, weight_dtype) == (torch.float32, torch.bfloat16)
        return torch.bfloat16 if on_cpu_kernels and bf16_weights_fp32_math else dtype
    kv_dtype = _KV_DTYPES[name]
    if kv_dtype == dtype:
        return kv_dtype
    if (dtype, kv_dtype) != (torch.float32, torch.bfloat16):
        raise ValueError(
            f"cache.kv_cache_dtype = {name} under {str(dtype).removeprefix('torch.')} math: "
            "the pools may be the math's dtype, or bfloat16 under float32 math"
        )
    if device.type != "cpu" or backend == "triton":
        raise ValueError(
            f"cache.kv_cache_dtype = {name} under float32 math runs on the CPU kernels only, "
            f"not on {device.type} with the {backend} attention backend"
        )
    return kv_dtype


def allocate_kv(
    model: nn.Module, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device
) -> KVCaches:
    # Per layer: K and V pools [kv_heads, num_pages, page_size, head_dim] (see attention.py).
    # On CPU on huge pages: decode attention reads their pages at scattered places.
    shape = model.shape
    kv_shape = (shape.num_kv_heads, num_pages, page_size, shape.head_dim)

    def pool() -> torch.Tensor:
        if device.type == "cpu":
            return host_memory.zeros(kv_shape, dtype)
        return torch.zeros(kv_shape, dtype=dtype, device=device)

    return [(pool(), pool()) for _ in range(shape.num_layers)]


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def build_runner(
    model: nn.Module,
    kv_caches: KVCaches,
    config: EngineConfig,
    device: torch.device,
    backend: str,
    runner_class: type[ModelRunner] = ModelRunner,
    dtype: torch.dtype | None = None,
) -> ModelRunner:
    """``dtype``: the math's, where the pools' (``kv_caches``) differs."""
    triton = None
    if backend == "triton":
        from yaied.worker.gpu_packing import TritonBatchPacker

        triton = TritonBatchPacker(
            config.cache.page_size, model.shape.num_kv_heads, device, num_sms(device)
        )
    return runner_class(
        model,
        kv_caches,
        config.cache.page_size,
        model.shape.vocab_size,
        device,
        seed=config.model.seed,
        triton=triton,
        batch_invariant=config.engine.batch_invariant,
        dtype=dtype,
    )


def capture_graphs(
    model: nn.Module, kv_caches: KVCaches, config: EngineConfig, max_len: int, device: torch.device
) -> DecodeGraphs:
    from yaied.worker.cuda_graphs import DecodeGraphs

    graphs = DecodeGraphs(
        model,
        kv_caches,
        config.scheduler.max_num_seqs,
        -(-max_len // config.cache.page_size),
        max_len,
        num_sms(device),
        device,
    )
    graphs.capture()
    return graphs
