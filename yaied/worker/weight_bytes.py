"""An estimate of the bytes a CPU engine's weights take once loaded, read from the model's files
without loading them (no torch): safetensors headers, a GGUF file's tensor table, or for random
weights (``load_format = "dummy"`` with no weight files) the config's shapes.

Floats are stored as the weights' dtype says (bf16 under ``auto`` on every CPU: 2 bytes; 4 under
``float32``). Quantized linears (the decoder layers' 2-D weights) take their blocks' bytes: a
GGUF file's own under ``gguf`` (``auto`` on a GGUF model), 34/32 and 18/32 bytes a weight packed
as ``q8_0`` and ``q4_0``. This is the steady state after the load, for the start-time memory
check (yaied/core/host_memory.py); None where the files say nothing countable.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator
from pathlib import Path

from yaied.core.config import ModelConfig
from yaied.worker import model_files

PACKED_BYTES_PER_WEIGHT = {"q8_0": 34 / 32, "q4_0": 18 / 32}  # a block: scale + 32 weights
# The GGUF block types whose tensors stay in their blocks (worker/quantized.py keeps these).
KEPT_GGUF_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
_MAX_HEADER = 100 * 2**20  # a safetensors JSON header larger than this is no model's


def estimate_weight_bytes(config: ModelConfig) -> int | None:
    """The loaded weights' bytes on CPU for ``config`` (see the module docstring)."""
    float_bytes = 4 if config.dtype == "float32" else 2
    gguf_path = None if config.load_format == "dummy" else model_files.gguf_file_of(config.model)
    mode = config.quantization
    if mode == "auto":
        mode = "gguf" if gguf_path is not None and config.dtype != "float16" else "none"
    try:
        tensors = list(_tensors(config, gguf_path))
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None  # files the load itself will refuse, with a better message
    total = 0
    counted = False
    for name, shape, gguf_type, nbytes in tensors:
        counted = True
        numel = math.prod(shape)
        linear = len(shape) == 2 and ("layers." in name or "blk." in name)
        if linear and mode == "gguf" and gguf_type in KEPT_GGUF_TYPES:
            total += nbytes
        elif linear and mode in PACKED_BYTES_PER_WEIGHT:
            total += math.ceil(numel * PACKED_BYTES_PER_WEIGHT[mode])
        else:
            total += numel * float_bytes
    return total if counted else None


Tensor = tuple[str, tuple[int, ...], str | None, int]  # name, shape, GGUF type, bytes in file


def _tensors(config: ModelConfig, gguf_path: Path | None) -> Iterator[Tensor]:
    if gguf_path is not None:
        from yaied.worker.gguf_reader import open_gguf  # deferred: gguf and numpy

        for tensor in open_gguf(gguf_path).tensors:
            shape = tuple(int(n) for n in tensor.shape)
            yield tensor.name, shape, tensor.tensor_type.name, int(tensor.n_bytes)
        return
    path = Path(config.model).expanduser()
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if files:
        for file in files:
            yield from _safetensors_header(file)
        return
    if config.load_format == "dummy":
        config_json = path / "config.json" if path.is_dir() else path
        if config_json.is_file():
            yield from _shapes_from_config(json.loads(config_json.read_text(encoding="utf-8")))


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
    cfg = cfg.get("text_config", cfg)
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
        for part, rows in (("q", heads), ("k", kv_heads), ("v", kv_heads), ("o", heads)):
            yield f"layers.{i}.{part}_proj.weight", (rows * head_dim, hidden), None, 0
        for part in ("gate", "up", "down"):
            yield f"layers.{i}.{part}_proj.weight", (inner, hidden), None, 0
