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
) -> ModelRunner:
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
