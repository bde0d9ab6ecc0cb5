"""Builds a ready model from a ModelConfig: resolve files, pick the implementation (native, or
transformers' own class on the paged KV cache), build the module, load weights."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from yaied.core.config import ModelConfig
from yaied.kernels.cpu_isa import has_bf16_math, selected_level
from yaied.worker import model_files
from yaied.worker.host_memory import return_freed_memory
from yaied.worker.models import build_model, check_supported
from yaied.worker.models.transformers_backend import build_transformers_model, check_remote_code
from yaied.worker.quantized import quantize_model, resolve_quantization

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class LoadedModel:
    model: nn.Module
    hf_config: object  # transformers PretrainedConfig
    folder: Path | None  # the Hugging Face folder; None for dummy models given as a config file
    dtype: torch.dtype  # the math's: activations, norms, KV cache
    max_model_len: int
    # Linear layers' weights as stored: bf16 under dtype auto on a CPU without bf16 math (the
    # worker wraps them, worker/cpu_linear.py), else ``dtype``.
    weight_dtype: torch.dtype | None = None
    # The decoder layers' projections: "none" (float, as weight_dtype says), or kept in blocks
    # ("gguf": the file's types; "q8_0", "q4_0": packed at load; worker/quantized.py).
    quantization: str = "none"


def resolve_dtype(name: str, device: torch.device, level: str | None = None) -> torch.dtype:
    """The math dtype. ``auto``: bfloat16 on GPUs and on CPUs with bf16 dot products (there bf16
    matmuls ran about 2.3x faster than fp32), float32 on other CPUs (where bf16 matmuls ran at a
    tenth of fp32's speed: docs/benchmarks.md). ``level``: the CPU's ISA level, found if None.
    Greedy parity tests ask for float32."""
    if name != "auto":
        return DTYPES[name]
    if device.type != "cpu":
        return torch.bfloat16
    return torch.bfloat16 if has_bf16_math(level or selected_level()) else torch.float32


def resolve_weight_dtype(name: str, device: torch.device, level: str | None = None) -> torch.dtype:
    """How linear weights are stored: bfloat16 under ``auto`` on every CPU, since a decode step
    is a pass over them and bf16 is half the bytes (fp32 math widens them in registers); the
    math dtype otherwise (a forced dtype is the weights' too)."""
    if name == "auto" and device.type == "cpu":
        return torch.bfloat16
    return resolve_dtype(name, device, level)


def load_model(
    config: ModelConfig, device: torch.device, *, show_progress: bool, level: str | None = None
) -> LoadedModel:
    started = time.perf_counter()
    dtype = resolve_dtype(config.dtype, device, level)
    folder, hf_config = _resolve_config(config, show_progress)
    max_len = max_model_len_of(hf_config, config.max_model_len)
    torch.manual_seed(config.seed)
    impl = pick_impl(config, hf_config)
    quantization, gguf_path = quantization_of(config, device, impl)
    if quantization != "none" and impl == "transformers":
        raise ValueError(
            f"model.quantization = {config.quantization} runs on the native models only; "
            "transformers' model classes take dequantized weights (model.quantization = none)"
        )
    if impl == "transformers":
        model = build_transformers_model(
            config.model,
            hf_config,
            folder,
            device=device,
            dtype=dtype,
            dummy=config.load_format == "dummy",
            trust_remote_code=config.trust_remote_code,
            max_model_len=max_len,
        )
    else:
        model = _load_native(
            config, folder, hf_config, device, dtype, show_progress, quantization, gguf_path
        )
    log.info(
        "loaded %s (%s, %s%s) in %.1fs",
        config.model,
        type(model).__name__,
        dtype,
        "" if quantization == "none" else f", linears {quantization}",
        time.perf_counter() - started,
    )
    weight_dtype = resolve_weight_dtype(config.dtype, device, level)
    return LoadedModel(model, hf_config, folder, dtype, max_len, weight_dtype, quantization)


def quantization_of(
    config: ModelConfig, device: torch.device, impl: str = "native"
) -> tuple[str, Path | None]:
    """The quantization the model loads with (worker/quantized.py) and the GGUF file whose
    blocks it keeps (None unless "gguf"). ``auto`` keeps a GGUF file's blocks where they run (on
    CPU, a native model, fp32 or bf16 math) and is "none" elsewhere; the others are refused off
    CPU and, for "gguf", without a GGUF file's weights."""
    if config.quantization == "gguf" and config.load_format == "dummy":
        raise ValueError(
            "model.quantization = gguf keeps a GGUF file's blocks, but model.load_format = "
            "dummy loads random weights: use q8_0 or q4_0 to pack them"
        )
    gguf_path = None if config.load_format == "dummy" else model_files.gguf_file_of(config.model)
    blocks_run = device.type == "cpu" and impl == "native" and config.dtype != "float16"
    if config.quantization == "auto" and not blocks_run:
        return "none", None
    mode = resolve_quantization(config.quantization, config.model, gguf_path)
    if mode != "none" and device.type != "cpu":
        raise ValueError(
            f"model.quantization = {mode} runs on CPU only (device {device.type}); use none"
        )
    return mode, gguf_path if mode == "gguf" else None


def pick_impl(config: ModelConfig, hf_config) -> str:
    """Which implementation runs the config, "native" or "transformers". auto prefers native
    wherever a native model runs the config, and trusted remote code always goes to transformers."""
    if config.model_impl == "transformers":
        return "transformers"
    try:
        if config.trust_remote_code:
            raise ValueError("trust_remote_code is not supported by native models")
        check_supported(hf_config)
    except ValueError as exc:
        if config.model_impl == "auto":
            return "transformers"
        raise ValueError(
            f'{exc} (model_impl = "transformers" or "auto" runs it through transformers\' '
            "own model class)"
        ) from None
    return "native"


def _load_native(
    config: ModelConfig,
    folder: Path | None,
    hf_config,
    device: torch.device,
    dtype: torch.dtype,
    show_progress: bool,
    quantization: str = "none",
    gguf_path: Path | None = None,
) -> nn.Module:
    # Quantized projections are packed from (or replace) fp32 weights: one rounding, not two.
    model = build_model(hf_config, device, torch.float32 if quantization != "none" else dtype)
    tables, absent = None, set()
    if quantization == "gguf":
        from yaied.worker.gguf_tables import read_tables, replaced_weights  # deferred: gguf-py

        # The blocks first: the float weights they replace are then never read, and their
        # memory (build_model's, never written) never touched.
        tables = read_tables(model, gguf_path)
        absent = replaced_weights(model, tables)
    if config.load_format == "dummy":
        init_dummy_weights(model, config.seed)
    else:
        weights = model_files.iter_safetensors_weights(
            folder, show_progress=show_progress, skip=absent
        )
        model.load_weights(weights, absent=absent)
    if quantization != "none":
        quantize_model(model, quantization, tables)
    model = model.to(dtype)
    if quantization != "none":
        return_freed_memory(collect=True)  # the fp32 weights the blocks replaced
    model.inv_freq = model.inv_freq.float()  # positions stay exact in fp32
    return model.eval()


def _resolve_config(config: ModelConfig, show_progress: bool) -> tuple[Path | None, object]:
    path = Path(config.model)
    if config.load_format == "dummy" and path.suffix == ".json" and path.is_file():
        from transformers import AutoConfig

        data = json.loads(path.read_text())
        model_type = data.pop("model_type")
        return None, AutoConfig.for_model(model_type, **data)
    cache_dir = Path(config.cache_dir) if config.cache_dir else None
    folder = model_files.resolve_model_folder(
        config.model, cache_dir=cache_dir, show_progress=show_progress
    )
    check_remote_code(config.model, folder, config.trust_remote_code)
    return folder, model_files.load_hf_config(folder, trust_remote_code=config.trust_remote_code)


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights for benchmarks of shapes whose weights we lack: small normal matrices, unit
    norms, so activations stay in range through many layers. Norms and biases are the same for
    every seed, so a tensor-parallel rank's replicated parameters agree with the others'."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        elif name.endswith("bias"):
            param.data.zero_()
        else:
            values = torch.randn(param.shape, generator=generator) * 0.02
            param.data.copy_(values)


def max_model_len_of(hf_config, configured: int) -> int:
    native = getattr(hf_config, "max_position_embeddings", None) or 2048
    if configured and configured > native:
        raise ValueError(f"max_model_len {configured} exceeds the model's context length {native}")
    return configured or native


def resolve_model_config(config: ModelConfig) -> tuple[Path | None, object]:
    """The model's folder and Hugging Face config, without building the model: what a router
    needs to tokenize and validate requests for engines that run elsewhere."""
    return _resolve_config(config, show_progress=False)
