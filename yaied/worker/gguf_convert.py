"""Convert a GGUF checkpoint into a Hugging Face folder: config, float32 safetensors, tokenizer.

The rest of yaied loads exactly one format (a Hugging Face folder), so a GGUF file is dequantized
once into that format and cached, instead of teaching every loader about GGML blocks.

What llama.cpp's converter changed, and what is undone here:

- tensor names (`blk.N.attn_q.weight` -> `model.layers.N.self_attn.q_proj.weight`);
- for arch `llama` only, the rows of Q and K are reordered inside each head. GGML's llama RoPE
  rotates adjacent pairs (2i, 2i+1) while Hugging Face rotates (i, i + head_dim/2) (`rotate_half`),
  so the converter interleaves the two halves of each head; `unpermute_rotary` puts them back.
  Qwen2/3 use GGML's NEOX RoPE, which already rotates halves, so their Q/K rows are untouched.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from tqdm import tqdm

from yaied.worker import model_cache
from yaied.worker.gguf_heads import count, read_heads
from yaied.worker.gguf_reader import metadata, open_gguf, required_metadata

logger = logging.getLogger(__name__)

# GGUF `general.architecture` -> (HF architectures entry, HF model_type).
_HF_ARCHS: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}
SUPPORTED_GGUF_ARCHS: tuple[str, ...] = tuple(_HF_ARCHS)

_GLOBAL_TENSORS: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSOR_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_LAYER_MODULES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Modules only some architectures have; anything else in a file would load as garbage or not at all.
_ARCH_EXTRA_MODULES: dict[str, dict[str, str]] = {
    "llama": {},
    "qwen2": {},
    "qwen3": {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
}
# GGUF general.sampling.* -> generation_config.json key.
_SAMPLING_KEYS: dict[str, str] = {
    "temp": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "penalty_repeat": "repetition_penalty",
}


def hf_tensor_name(gguf_name: str, arch: str) -> str:
    """The Hugging Face parameter name for a GGUF tensor name; ValueError if it has none."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _LAYER_TENSOR_RE.match(gguf_name)
    modules = _LAYER_MODULES | _ARCH_EXTRA_MODULES[arch]
    if match is None or match.group(2) not in modules:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart for {arch!r}")
    layer, kind, suffix = match.groups()
    return f"model.layers.{layer}.{modules[kind]}.{suffix}"


def unpermute_rotary(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleave of Q/K rows (weights or biases).

    llama.cpp wrote rows as reshape(heads, 2, head_dim/2).swapaxes(1, 2); the inverse reads them as
    (heads, head_dim/2, 2) and swaps back, leaving each head as [first half | second half].
    """
    rows = weights.shape[0]
    head_dim = rows // num_heads
    grouped = weights.reshape(num_heads, head_dim // 2, 2, *weights.shape[1:])
    return np.ascontiguousarray(grouped.swapaxes(1, 2).reshape(weights.shape))


def _rope_scaling(reader: gguf.GGUFReader, arch: str) -> dict[str, Any] | None:
    kind = metadata(reader, f"{arch}.rope.scaling.type")
    if kind is None or kind == "none":
        return None
    factor = float(metadata(reader, f"{arch}.rope.scaling.factor", 1.0))
    if kind == "linear":
        return {"rope_type": "linear", "type": "linear", "factor": factor}
    if kind == "yarn":
        scaling: dict[str, Any] = {"rope_type": "yarn", "type": "yarn", "factor": factor}
        original = metadata(reader, f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            value = metadata(reader, f"{arch}.rope.scaling.{gguf_key}")
            if value is not None:
                scaling[hf_key] = float(value)
        return scaling
    raise ValueError(f"GGUF rope scaling type {kind!r} is not supported (only linear and yarn)")


def _build_config(
    reader: gguf.GGUFReader, arch: str, shapes: dict[str, list[int]]
) -> dict[str, Any]:
    """config.json for the HF class of `arch`; sizes are taken from tensor shapes where possible."""
    needed = (
        "token_embd.weight",
        "blk.0.attn_q.weight",
        "blk.0.attn_k.weight",
        "blk.0.ffn_up.weight",
    )
    missing = [name for name in needed if name not in shapes]
    if missing:
        raise ValueError(f"GGUF file lacks tensors {missing}; is it a complete {arch} model?")
    heads = read_heads(reader, arch, shapes)  # checked against each other and the tensors
    num_heads, num_kv_heads, head_dim = heads.num_heads, heads.num_kv_heads, heads.head_dim
    num_layers = count(
        reader, f"{arch}.block_count", required_metadata(reader, f"{arch}.block_count")
    )
    present = {int(m.group(1)) for m in map(_LAYER_TENSOR_RE.match, shapes) if m is not None}
    absent = [layer for layer in range(num_layers) if layer not in present]
    if absent:
        raise ValueError(
            f"GGUF metadata {arch}.block_count = {num_layers}, but the file has no tensors of "
            f"block {absent[0]}: corrupt metadata, or an incomplete file"
        )
    rope_dim = metadata(reader, f"{arch}.rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise ValueError(
            f"GGUF metadata {arch}.rope.dimension_count = {rope_dim}, but heads are {head_dim} "
            "wide: wrong head counts, or partial rotary, which yaied does not support"
        )
    hf_arch, model_type = _HF_ARCHS[arch]
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": shapes["token_embd.weight"][1],
        "intermediate_size": shapes["blk.0.ffn_up.weight"][0],
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(metadata(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        # 10000 is llama.cpp's own default when a file names no base.
        "rope_theta": float(metadata(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(metadata(reader, f"{arch}.context_length", 4096)),
        "vocab_size": shapes["token_embd.weight"][0],
        "tie_word_embeddings": "output.weight" not in shapes,
        "bos_token_id": metadata(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    pad_id = metadata(reader, "tokenizer.ggml.padding_token_id")
    if pad_id is not None:
        config["pad_token_id"] = int(pad_id)
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in shapes
        config["mlp_bias"] = False
    elif arch == "qwen2":
        config["use_sliding_window"] = False
    elif arch == "qwen3":
        config["attention_bias"] = "blk.0.attn_q.bias" in shapes
        config["use_sliding_window"] = False
    scaling = _rope_scaling(reader, arch)
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config


def _generation_config(reader: gguf.GGUFReader) -> dict[str, Any]:
    """generation_config.json: ids, plus the sampling defaults the file recommends, if any."""
    # llama.cpp stops on every end-of-generation token, not only eos (Llama 3's <|eot_id|>).
    eos_ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = metadata(reader, f"tokenizer.ggml.{key}")
        if value is not None and int(value) not in eos_ids:
            eos_ids.append(int(value))
    generation: dict[str, Any] = {"bos_token_id": metadata(reader, "tokenizer.ggml.bos_token_id")}
    if eos_ids:
        generation["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    pad_id = metadata(reader, "tokenizer.ggml.padding_token_id")
    if pad_id is not None:
        generation["pad_token_id"] = int(pad_id)
    sampling = {
        hf_key: metadata(reader, f"general.sampling.{gguf_key}")
        for gguf_key, hf_key in _SAMPLING_KEYS.items()
    }
    sampling = {key: value for key, value in sampling.items() if value is not None}
    if sampling:
        generation["do_sample"] = True
        generation.update(sampling)
    return generation


def _write_safetensors(
    path: Path, entries: list[tuple[str, list[int], Callable[[], np.ndarray]]], progress: tqdm
) -> None:
    """Stream float32 tensors into one safetensors file, holding one tensor in memory at a time.

    Layout (the safetensors spec): u64 little-endian header size | JSON header padded with spaces
    to 8 bytes | raw little-endian data in header order. `safetensors.torch.save_file` would need
    every dequantized tensor in memory at once (4x the parameter count in bytes).
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, _ in entries:
        size = 4 * int(np.prod(shape, dtype=np.int64))
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    with path.open("wb") as out:
        out.write(struct.pack("<Q", len(header_bytes)))
        out.write(header_bytes)
        for name, shape, produce in entries:
            array = np.ascontiguousarray(produce(), dtype="<f4")
            if list(array.shape) != shape:
                raise ValueError(f"{name}: expected shape {shape}, got {list(array.shape)}")
            out.write(array.data)
            progress.update(1)


def _tensor_entries(
    reader: gguf.GGUFReader, arch: str, config: dict[str, Any]
) -> list[tuple[str, list[int], Callable[[], np.ndarray]]]:
    """(HF name, numpy shape, dequantizing thunk) per tensor, in file order."""
    num_layers = config["num_hidden_layers"]
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    entries = []
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":
            raise ValueError("GGUF rope_freqs (llama3-style rope scaling) is not supported")
        hf_name = hf_tensor_name(tensor.name, arch)
        match = _LAYER_TENSOR_RE.match(tensor.name)
        if match is not None and int(match.group(1)) >= num_layers:
            raise ValueError(f"GGUF tensor {tensor.name!r} is beyond block_count {num_layers}")
        permute_heads = heads.get(match.group(2)) if match and arch == "llama" else None

        def produce(tensor: Any = tensor, permute_heads: int | None = permute_heads) -> np.ndarray:
            try:
                weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            except (ValueError, NotImplementedError) as exc:
                raise ValueError(
                    f"GGUF tensor {tensor.name!r} ({tensor.tensor_type.name}) cannot be "
                    f"dequantized: {exc}"
                ) from exc
            _check_finite(tensor.name, tensor.tensor_type.name, weights)
            return weights if permute_heads is None else unpermute_rotary(weights, permute_heads)

        # GGUF lists dims fastest-first (ne order); numpy and torch list them slowest-first.
        shape = [int(dim) for dim in reversed(tensor.shape.tolist())]
        entries.append((hf_name, shape, produce))
    return entries


def _check_finite(name: str, kind: str, weights: np.ndarray) -> None:
    """ValueError naming the tensor if a weight is NaN or infinite (a corrupt scale or value):
    otherwise every request that meets it fails, or one row of the embeddings waits for the
    prompt that reads it."""
    finite = np.isfinite(weights)
    if not finite.all():
        row = int(np.argwhere(~finite)[0][0]) if weights.ndim > 1 else 0
        raise ValueError(
            f"GGUF tensor {name!r} ({kind}) holds NaN or infinite weights (row {row} first): "
            "corrupt scales or values"
        )


def _save_tokenizer(gguf_path: Path, reader: gguf.GGUFReader, out_dir: Path) -> None:
    if metadata(reader, "tokenizer.ggml.model") is None:
        logger.warning("%s carries no tokenizer; the folder will have none", gguf_path)
        return
    from transformers import AutoTokenizer  # deferred: heavy, and HF_HUB_OFFLINE is read on import

    tokenizer = AutoTokenizer.from_pretrained(
        str(gguf_path.parent),
        gguf_file=gguf_path.name,
        local_files_only=True,
        trust_remote_code=False,
    )
    chat_template = metadata(reader, "tokenizer.chat_template")
    if chat_template is not None and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(str(out_dir))


def convert_gguf_to_hf_folder(
    gguf_path: Path, out_dir: Path, *, show_progress: bool = True
) -> Path:
    """Dequantize `gguf_path` into a new Hugging Face folder at `out_dir` and return `out_dir`.

    Written into a temporary sibling, sealed (every file fsynced, the completion marker last) and
    renamed at the end, so `out_dir` either does not exist or is complete, even after a power
    loss (see model_cache.py). If another process finished the same folder first, its copy is
    kept.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} already exists; remove it to convert again")
    reader = open_gguf(gguf_path)
    arch = metadata(reader, "general.architecture")
    if arch not in _HF_ARCHS:
        raise ValueError(
            f"{gguf_path}: GGUF architecture {arch!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_GGUF_ARCHS)}"
        )
    shapes = {t.name: [int(d) for d in reversed(t.shape.tolist())] for t in reader.tensors}
    config = _build_config(reader, arch, shapes)
    entries = _tensor_entries(reader, arch, config)

    tmp_dir = model_cache.temporary_folder(out_dir)
    try:
        with tqdm(
            total=len(entries),
            desc=f"Converting {gguf_path.name}",
            unit="tensor",
            disable=not show_progress,
        ) as progress:
            _write_safetensors(tmp_dir / "model.safetensors", entries, progress)
        (tmp_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        generation = _generation_config(reader)
        (tmp_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        _save_tokenizer(gguf_path, reader, tmp_dir)
        model_cache.seal(tmp_dir)
        try:
            model_cache.publish(tmp_dir, out_dir)
        except OSError:
            if not model_cache.is_complete(out_dir):
                raise
            logger.info("%s was converted concurrently; keeping that copy", out_dir)
            shutil.rmtree(tmp_dir, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return out_dir
