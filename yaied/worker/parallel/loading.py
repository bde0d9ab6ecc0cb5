"""Loading one rank's shard: the model resolved once (a GGUF converted by rank 0 before any
other rank starts), the shard's layers built, and only its slices read from the files."""

from __future__ import annotations

import logging
import os
import time

import torch

from yaied.core.config import EngineConfig
from yaied.worker.loader import (
    LoadedModel,
    init_dummy_weights,
    max_model_len_of,
    pick_impl,
    resolve_dtype,
    resolve_model_config,
)
from yaied.worker.models import check_supported
from yaied.worker.models.llama import LlamaShape
from yaied.worker.parallel.group import RankGroup
from yaied.worker.parallel.layers import build_shard_model, pack_shard
from yaied.worker.parallel.plan import ShardPlan, check_divisible, iter_shard_weights

log = logging.getLogger(__name__)


def resolve_shape(config: EngineConfig) -> tuple[object, LlamaShape]:
    """The model's config and whole shape, refused with one line when it cannot be split: the
    transformers-backed path runs on one device, and the heads must divide among the ranks."""
    world_size = config.engine.tensor_parallel_size
    _, hf_config = resolve_model_config(config.model)
    if pick_impl(config.model, hf_config) == "transformers":
        raise ValueError(
            f"tensor_parallel_size {world_size} needs a native model; the transformers-backed "
            f"path (model_impl = {config.model.model_impl!r}, architecture "
            f"{getattr(hf_config, 'architectures', None)}) runs on one device only"
        )
    check_supported(hf_config)
    shape = LlamaShape.from_hf_config(hf_config)
    check_divisible(shape, world_size)
    return hf_config, shape


def load_shard(
    config: EngineConfig, rank: int, group: RankGroup, device: torch.device
) -> LoadedModel:
    started = time.perf_counter()
    folder, hf_config = resolve_model_config(config.model)
    shape = LlamaShape.from_hf_config(hf_config)
    plan = ShardPlan(shape, rank, config.engine.tensor_parallel_size)
    dtype = resolve_dtype(config.model.dtype, device)
    torch.manual_seed(config.model.seed)
    model = build_shard_model(hf_config, plan, group, device, dtype)
    if config.model.load_format == "dummy":
        init_dummy_weights(model, config.model.seed + rank)
    else:
        model.load_weights(iter_shard_weights(folder, plan))
    model = model.to(dtype)
    model.inv_freq = model.inv_freq.float()  # positions stay exact in fp32
    model.eval()
    pack_shard(model, config.scheduler.max_num_batched_tokens)
    log.info(
        "rank %d (pid %d): loaded its shard of %s in %.1fs",
        rank,
        os.getpid(),
        config.model.model,
        time.perf_counter() - started,
    )
    max_len = max_model_len_of(hf_config, config.model.max_model_len)
    return LoadedModel(model, hf_config, folder, dtype, max_len)
