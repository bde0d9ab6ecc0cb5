"""An estimate of the bytes a CPU engine's weights take once loaded and made ready for the CPU
kernels (worker/loader.py, then worker/cpu_model.py), read from the model's files without loading
them (no torch): safetensors headers, a GGUF file's tensor table, or for random weights
(``load_format = "dummy"`` with no weight files) the config's shapes. Two figures (WeightBytes):

- ``least``: the copies the load always keeps, whatever the memory: each float weight once in
  the dtype it is stored in, each quantized projection's blocks.
- ``expected``: with the copies the CPU path adds where they fit in physical memory (shares of
  it as worker/cpu_linear.py caps them) and where the C kernels build. With bf16 math (the
  avx512_bf16 level under ``auto``) each float linear keeps oneDNN's packed copy and the few-row
  kernel's; with fp32 math over bf16 weights (every other level under ``auto``) a linear keeps
  its bf16 copy and an fp32 one, and the embeddings, norms and biases are fp32. A head tied to
  the embeddings adds the copies of a linear over the embedding's weight.

Quantized projections (``model.quantization``) take their blocks' bytes: a GGUF file's own under
``gguf`` (``auto`` on a GGUF model) where every part of a fused projection has a kernel
(worker/gguf_tables.py), else the projection stays float; 34/32 and 18/32 bytes a weight packed
as ``q8_0`` and ``q4_0``, whose LM head is Q8_0. A head in blocks that the embeddings are tied to
serves them too: they cost nothing more. Tensor-parallel ranks (``ranks`` > 1) load floats in the
math dtype whatever the quantization (worker/parallel/loading.py), the LM head apart from the
embeddings, and under bf16 math keep the row-parallel projections' weights beside their packed
copies. For the start-time memory check (yaied/core/host_memory.py); None where the files say
nothing countable.
"""

from __future__ import annotations

import functools
import json
import math
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from yaied.core.config import ModelConfig
from yaied.kernels.cpu_build import find_compiler, kernels_disabled
from yaied.kernels.cpu_isa import IsaError, detected_level, has_bf16_math, level_rank
from yaied.kernels.cpu_isa import selected_level as _selected_level
from yaied.worker import model_files

PACKED_BYTES_PER_WEIGHT = {"q8_0": 34 / 32, "q4_0": 18 / 32}  # a block: scale + 32 weights
HEAD_PACKED_BYTES_PER_WEIGHT = 34 / 32  # q8_0 and q4_0 both pack the LM head in Q8_0
# The GGML type numbers whose tensors stay in their blocks: kernels/cpu_quant.py's BY_GGML_ID
# (Q8_0, Q4_0, Q4_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS; that module loads torch, so
# a test checks they agree).
KEPT_GGML_IDS = frozenset({8, 2, 3, 10, 11, 12, 13, 14, 20, 23})
# worker/cpu_linear.py's caps on its optional copies (that module loads torch; a test checks).
GEMV_MEMORY_SHARE = 0.125
FP32_COPY_MEMORY_SHARE = 0.25
# A fused projection's GGUF parts (worker/quantized.py's PARTS), and the row-parallel ones
FUSED = dict.fromkeys(("attn_q", "attn_k", "attn_v"), "qkv")
FUSED |= dict.fromkeys(("ffn_gate", "ffn_up"), "gate_up")
ROW_PARALLEL = ("o_proj", "down_proj", "attn_output", "ffn_down")
_MAX_HEADER = 100 * 2**20  # a safetensors JSON header larger than this is no model's


class WeightBytes(NamedTuple):
    least: int  # the copies always kept: what the engine cannot run in less than
    expected: int  # with the copies kept where they fit: the estimate


@dataclass
class _Weights:
    """A model's weights by what the CPU path does with them (numbers of weights, or bytes)."""

    embed: int = 0
    head: int = 0  # the LM head's weights: the embeddings' when tied
    tied: bool = False
    head_blocks: int | None = None  # a GGUF head's bytes in a type with a kernel
    # decoder projections: (weights, GGUF bytes where every part has a kernel, row-parallel)
    projections: dict[str, list] = field(default_factory=dict)
    other: int = 0  # norms, biases


def estimate_weight_bytes(
    config: ModelConfig,
    *,
    level: str | None = None,
    ranks: int = 1,
    kernels: bool | None = None,
    memory: int | None = None,
) -> WeightBytes | None:
    """The weights' bytes on CPU for ``config`` (see the module docstring) at ISA ``level``
    (the selected one if None) over ``ranks`` tensor-parallel processes together; ``kernels``:
    whether the C kernels build (a compiler, not switched off) if None; ``memory``: physical
    memory as worker/cpu_linear.py reads it if None."""
    if level is None:
        try:
            level = _selected_level()
        except IsaError:  # the engine refuses it with its own line
            level = detected_level()
    if kernels is None:
        kernels = find_compiler() is not None and not kernels_disabled()
    if memory is None:
        memory = _physical_memory()
    gguf_path = None if config.load_format == "dummy" else model_files.gguf_file_of(config.model)
    mode = config.quantization
    if mode == "auto":
        mode = "gguf" if gguf_path is not None and config.dtype != "float16" else "none"
    try:
        weights = _classify(config, gguf_path)
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None  # files the load itself will refuse, with a better message
    if weights is None:
        return None
    math_bytes = _math_bytes(config.dtype, level)
    if ranks > 1:
        return _shards(weights, math_bytes, level)
    return _one_process(weights, mode, config.dtype, math_bytes, level, kernels, memory)


def weight_estimate(config: ModelConfig) -> Callable[[int], WeightBytes | None]:
    """``estimate_weight_bytes`` of ``config`` as a function of the engine's ranks, each figure
    read once: the start's check and those of engines added while serving count every engine
    at its own tensor_parallel_size (an ``[[engines]]`` entry's, else the config's), since
    ranks keep float shards whatever the quantization where one process keeps its blocks."""
    return functools.cache(lambda ranks: estimate_weight_bytes(config, ranks=ranks))


def _math_bytes(dtype: str, level: str) -> int:
    """Bytes a weight in the math dtype (worker/loader.py resolve_dtype, on CPU)."""
    if dtype == "auto":
        return 2 if has_bf16_math(level) else 4
    return 4 if dtype == "float32" else 2


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 0  # as cpu_linear's _fits: no optional copy fits


def _one_process(
    w: _Weights, mode: str, dtype: str, math_bytes: int, level: str, kernels: bool, memory: int
) -> WeightBytes:
    blocks, floats = 0, 0  # the projections' bytes in blocks, their float weights
    for numel, kept, _ in w.projections.values():
        if mode == "gguf" and kept is not None:
            blocks += kept
        elif mode in PACKED_BYTES_PER_WEIGHT:
            blocks += math.ceil(numel * PACKED_BYTES_PER_WEIGHT[mode])
        else:
            floats += numel
    head_blocks = None
    if mode == "gguf":
        head_blocks = w.head_blocks
    elif mode in PACKED_BYTES_PER_WEIGHT:
        head_blocks = math.ceil(w.head * HEAD_PACKED_BYTES_PER_WEIGHT)
    tied_head = w.head if w.tied and head_blocks is None else 0  # a float head over the embedding
    if head_blocks is not None:
        blocks += head_blocks
    elif not w.tied:
        floats += w.head
    embed = 0 if w.tied and head_blocks is not None else w.embed  # else read from the head
    least = expected = blocks + (embed + w.other) * math_bytes
    if dtype == "auto" and math_bytes == 4:  # fp32 math over bf16 linears (store_linears_bf16)
        least += (floats + tied_head) * 2
        expected = least
        keep_fp32 = floats * 4 <= FP32_COPY_MEMORY_SHARE * memory
        if keep_fp32:
            expected += floats * 4
        panels = kernels and mode == "none" and level_rank(level) >= level_rank("avx2")
        if panels and keep_fp32 and (floats + tied_head) * 4 <= FP32_COPY_MEMORY_SHARE * memory:
            expected += tied_head * 4  # the panel matmul's copy of the tied head
    elif math_bytes == 2 and dtype != "float16":  # bf16 math: pack_linears
        least += floats * 2
        expected = least
        if level_rank(level) >= level_rank("avx512"):
            expected += tied_head * 2  # oneDNN's packed copy beside the embedding
        if kernels and (floats + tied_head) * 2 <= GEMV_MEMORY_SHARE * memory:
            expected += (floats + tied_head) * 2  # the few-row kernel's copy
    else:  # fp32 weights (panels replace them) or fp16: one copy
        least += floats * math_bytes
        expected = least
        panels = kernels and mode == "none" and level_rank(level) >= level_rank("avx2")
        if panels and dtype == "float32" and tied_head * 4 <= FP32_COPY_MEMORY_SHARE * memory:
            expected += tied_head * 4
    return WeightBytes(least, expected)


def _shards(w: _Weights, math_bytes: int, level: str) -> WeightBytes:
    """Every rank's shard together: floats in the math dtype, the head its own copy."""
    floats = sum(numel for numel, _, _ in w.projections.values())
    least = (w.embed + w.head + floats + w.other) * math_bytes
    expected = least
    if math_bytes == 2 and level_rank(level) >= level_rank("avx512"):  # worker/parallel/layers.py
        row = sum(numel for numel, _, row_parallel in w.projections.values() if row_parallel)
        expected += row * 2  # pack_shard keeps the row-parallel weights beside the packed ones
    return WeightBytes(least, expected)


Tensor = tuple[str, tuple[int, ...], int | None, int]  # name, shape, GGML type, bytes in file


def _classify(config: ModelConfig, gguf_path: Path | None) -> _Weights | None:
    tensors, tie_setting = _tensors(config, gguf_path)
    if not tensors:
        return None
    w = _Weights()
    names = {name for name, _, _, _ in tensors}
    for name, shape, ggml_type, nbytes in tensors:
        numel = math.prod(shape)
        if "embed_tokens" in name or name == "token_embd.weight":
            w.embed += numel
        elif name in ("lm_head.weight", "output.weight"):
            w.head += numel
        elif len(shape) == 2 and ("layers." in name or name.startswith("blk.")):
            layer, part = _projection(name)
            entry = w.projections.setdefault(layer, [0, 0, part in ROW_PARALLEL])
            entry[0] += numel
            if ggml_type not in KEPT_GGML_IDS:  # one part without a kernel: all stays float
                entry[1] = None
            elif entry[1] is not None:
                entry[1] += nbytes
        else:
            w.other += numel
    if gguf_path is not None:  # worker/gguf_tables.py read_tables' head
        w.tied = "output.weight" not in names
        head_name = "token_embd.weight" if w.tied else "output.weight"
        head = next((t for t in tensors if t[0] == head_name), None)
        if head is not None and head[2] in KEPT_GGML_IDS:
            w.head_blocks = head[3]
    else:
        w.tied = tie_setting if tie_setting is not None else "lm_head.weight" not in names
    if w.tied:
        w.head = w.embed
    return w


def _projection(name: str) -> tuple[str, str]:
    """(the projection a 2-D decoder weight belongs to, its part): fused parts share one."""
    stem = name.removesuffix(".weight")
    parent, _, part = stem.rpartition(".")
    return f"{parent}.{FUSED.get(part, part)}", part


def _tensors(config: ModelConfig, gguf_path: Path | None) -> tuple[list[Tensor], bool | None]:
    """The model's tensors, and its config's tie_word_embeddings where it says."""
    if gguf_path is not None:
        from yaied.worker.gguf_reader import tensor_table  # deferred: gguf and numpy

        return list(tensor_table(gguf_path)), None
    path = Path(config.model).expanduser()
    config_json = path / "config.json" if path.is_dir() else path
    cfg = {}
    if config_json.is_file() and config_json.suffix == ".json":
        cfg = json.loads(config_json.read_text(encoding="utf-8"))
        cfg = cfg.get("text_config", cfg) if isinstance(cfg, dict) else {}
    tie = cfg.get("tie_word_embeddings") if isinstance(cfg, dict) else None
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if files:
        return [t for file in files for t in _safetensors_header(file)], tie
    if config.load_format == "dummy":
        return list(_shapes_from_config(cfg)), bool(tie)
    return [], None


def _safetensors_header(file: Path) -> Iterator[Tensor]:
    with file.open("rb") as source:
        (length,) = struct.unpack("<Q", source.read(8))
        if length > _MAX_HEADER:
            raise ValueError(f"{file}: a safetensors header of {length} bytes is not a model's")
        header = json.loads(source.read(length))
    for name, info in header.items():
        if name != "__metadata__":
            yield name, tuple(info["shape"]), None, 0


def _shapes_from_config(cfg: dict) -> Iterator[Tensor]:
    """A decoder-only transformer's weights from its config: embeddings (and an untied head),
    attention and a gated MLP per layer. Norms and biases are left out (a rounding error)."""
    try:
        hidden, layers = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
        vocab, inner = int(cfg["vocab_size"]), int(cfg["intermediate_size"])
        heads = int(cfg["num_attention_heads"])
    except (KeyError, TypeError, ValueError):
        return  # not a shape this estimate knows: the check counts no weights
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    yield "embed_tokens.weight", (vocab, hidden), None, 0
    if not cfg.get("tie_word_embeddings", False):
        yield "lm_head.weight", (vocab, hidden), None, 0
    for i in range(layers):
        for part, rows in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
            yield f"layers.{i}.{part}_proj.weight", (rows * head_dim, hidden), None, 0
        yield f"layers.{i}.o_proj.weight", (hidden, heads * head_dim), None, 0
        for part in ("gate", "up"):
            yield f"layers.{i}.{part}_proj.weight", (inner, hidden), None, 0
        yield f"layers.{i}.down_proj.weight", (hidden, inner), None, 0
