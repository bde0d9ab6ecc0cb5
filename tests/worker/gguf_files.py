"""Tiny GGUF files written with gguf-py's GGUFWriter, as llama.cpp's converter and quantize
write them: llama (Q/K rows interleaved per head), qwen2 (Q/K/V biases) or qwen3 (Q/K norms),
tied or untied embeddings, GQA, and any GGML type per tensor. gguf-py packs Q8_0, Q4_0, Q4_1,
Q5_0, Q5_1, F16 and BF16 itself; the K and IQ4 types (which it only unpacks) are random blocks with
small scales, so each is a valid table whose weights gguf-py's own dequantize gives."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

T = gguf.GGMLQuantizationType
# The types gguf-py packs from floats.
PACKED_BY_GGUF_PY = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1)
# Byte offsets of the fp16 scales (d, and dmin where the type has one) in a block of each K
# type, and the value written there: dmin is d times the mean quant, so that the weights'
# mean is near 0 (random sub-block scales and mins alike).
_K_SCALES: dict[T, tuple[tuple[int, float], ...]] = {
    T.Q2_K: ((80, 0.01), (82, 0.015)),
    T.Q3_K: ((108, 0.002),),
    T.Q4_K: ((0, 0.0003), (2, 0.00225)),
    T.Q5_K: ((0, 0.00015), (2, 0.0023)),
    T.Q6_K: ((208, 0.00005),),
    # every 4-bit index picks a value of -127..113: d (IQ4_XS: times its scales of -32..31)
    T.IQ4_NL: ((0, 0.002),),
    T.IQ4_XS: ((0, 0.00012),),
}
PARTS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@dataclass
class Shape:
    arch: str = "llama"
    hidden: int = 64
    ffn: int = 256
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    vocab: int = 64
    tied: bool = False
    # metadata written instead of the true value: {"head_count": 8}
    lie: dict[str, int] = field(default_factory=dict)


def k_blocks(kind: T, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, size=(rows, k // block_size, block_bytes), dtype=np.uint8)
    for offset, value in _K_SCALES[kind]:
        blocks[..., offset : offset + 2] = np.array([value], dtype=np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def tensor_data(kind: T, weights: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``weights`` [rows, k] in GGML type ``kind``: packed by gguf-py, or random K blocks."""
    if kind == T.F32:
        return weights
    if kind == T.F16:
        return weights.astype(np.float16)
    if kind in _K_SCALES:
        return k_blocks(kind, *weights.shape, rng)
    return gguf.quants.quantize(weights, kind)


def write_gguf(
    path: Path,
    shape: Shape,
    type_of: Callable[[str], T],
    seed: int = 0,
    edit: Callable[[gguf.GGUFWriter], None] | None = None,
) -> Path:
    """A GGUF model of ``shape`` whose tensor ``name`` is in ``type_of(name)`` (norms stay F32).
    ``edit`` may add metadata before the file is written."""
    rng = np.random.default_rng(seed)
    s = shape
    writer = gguf.GGUFWriter(str(path), s.arch)
    meta = dict(head_count=s.heads, head_count_kv=s.kv_heads, block_count=s.layers)
    meta = meta | {"embedding_length": s.hidden} | s.lie
    writer.add_block_count(meta["block_count"])
    writer.add_context_length(512)
    writer.add_embedding_length(meta["embedding_length"])
    writer.add_feed_forward_length(s.ffn)
    writer.add_head_count(meta["head_count"])
    writer.add_head_count_kv(meta["head_count_kv"])
    if "key_length" in meta or s.arch == "qwen3":
        writer.add_key_length(meta.get("key_length", s.head_dim))
        writer.add_value_length(meta.get("key_length", s.head_dim))
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(s.vocab)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if edit is not None:
        edit(writer)

    def rand(*dims: int, scale: float = 0.1) -> np.ndarray:
        return (rng.standard_normal(dims) * scale).astype(np.float32)

    def add(name: str, weights: np.ndarray) -> None:
        kind = type_of(name) if weights.ndim == 2 else T.F32
        data = tensor_data(kind, weights, rng)
        writer.add_tensor(name, data, raw_dtype=None if kind in (T.F32, T.F16) else kind)

    add("token_embd.weight", rand(s.vocab, s.hidden, scale=0.5))
    writer.add_tensor("output_norm.weight", 1 + rand(s.hidden))
    if not s.tied:
        add("output.weight", rand(s.vocab, s.hidden, scale=0.3))
    q_rows, kv_rows = s.heads * s.head_dim, s.kv_heads * s.head_dim
    rows = {"attn_q": q_rows, "attn_k": kv_rows, "attn_v": kv_rows, "attn_output": s.hidden,
            "ffn_gate": s.ffn, "ffn_up": s.ffn, "ffn_down": s.hidden}  # fmt: skip
    columns = dict.fromkeys(PARTS, s.hidden) | {"attn_output": q_rows, "ffn_down": s.ffn}
    for layer in range(s.layers):
        p = f"blk.{layer}."
        writer.add_tensor(p + "attn_norm.weight", 1 + rand(s.hidden))
        writer.add_tensor(p + "ffn_norm.weight", 1 + rand(s.hidden))
        for part in PARTS:
            weights = rand(rows[part], columns[part], scale=0.15)
            if s.arch == "llama" and part in ("attn_q", "attn_k"):
                weights = interleave(weights, s.heads if part == "attn_q" else s.kv_heads)
            add(p + part + ".weight", weights)
        if s.arch == "qwen2":
            for part in ("attn_q", "attn_k", "attn_v"):
                writer.add_tensor(p + part + ".bias", rand(rows[part]))
        if s.arch == "qwen3":
            writer.add_tensor(p + "attn_q_norm.weight", 1 + rand(s.head_dim))
            writer.add_tensor(p + "attn_k_norm.weight", 1 + rand(s.head_dim))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def interleave(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's interleave of each head's Q/K rows (what the loader undoes)."""
    half = weights.shape[0] // heads // 2
    grouped = weights.reshape(heads, 2, half, *weights.shape[1:])
    return np.ascontiguousarray(grouped.swapaxes(1, 2).reshape(weights.shape))


def q4_k_m(name: str) -> T:
    """llama.cpp's Q4_K_M: Q4_K, with V and the FFN's down projection of some layers and the
    output in Q6_K (llama-quant.cpp's use_more_bits; here layer 0)."""
    if name == "output.weight" or name in ("blk.0.attn_v.weight", "blk.0.ffn_down.weight"):
        return T.Q6_K
    return T.Q4_K


def q5_k_m(name: str) -> T:
    """llama.cpp's Q5_K_M: q4_k_m's mix with Q5_K in place of Q4_K."""
    return T.Q5_K if q4_k_m(name) == T.Q4_K else T.Q6_K


def q3_k_m(name: str) -> T:
    """llama.cpp's Q3_K_M (llama-quant.cpp): Q3_K, with the attention output in Q4_K, V and the
    FFN's down projection of the first layers in Q5_K (later ones Q4_K) and the output in Q6_K;
    here layer 0 is one of the first. (A tied file's token_embd, the head, is Q6_K in
    llama.cpp's; Q3_K here, so that a Q3_K head and embeddings are tested too.)"""
    layer = name.split(".")[1] if name.startswith("blk.") else ""
    if name == "output.weight":
        return T.Q6_K
    if name.endswith(("attn_v.weight", "ffn_down.weight")):
        return T.Q5_K if layer == "0" else T.Q4_K
    if name.endswith("attn_output.weight"):
        return T.Q4_K
    return T.Q3_K


def q2_k(name: str) -> T:
    """llama.cpp's Q2_K mix: Q2_K, with V and the FFN's down projection in Q3_K (Q4_K for V in
    the first layers, here layer 0), the attention output in Q3_K and the output in Q6_K."""
    if name == "output.weight":
        return T.Q6_K
    if name == "blk.0.attn_v.weight":
        return T.Q4_K
    if name.endswith(("attn_v.weight", "ffn_down.weight", "attn_output.weight")):
        return T.Q3_K
    return T.Q2_K


def iq4_xs(name: str) -> T:
    """llama.cpp's IQ4_XS: IQ4_XS, the output in Q6_K, and IQ4_NL for a tensor whose rows are
    not whole super-blocks of 256 (here the FFN's down projection, as for a model whose FFN
    width is not a multiple of 256)."""
    if name == "output.weight":
        return T.Q6_K
    if name.endswith("ffn_down.weight"):
        return T.IQ4_NL
    return T.IQ4_XS


def every(kind: T) -> Callable[[str], T]:
    return lambda name: kind


# ---- corrupting a written file: its tensor infos (name, n_dims u32, dims u64 each, type u32,
# offset u64 from the data section's start) and its tables ----


def _info_at(data: bytearray, name: str) -> tuple[int, int]:
    """Where tensor ``name``'s dims start in the header, and how many it has."""
    encoded = name.encode()
    at = data.index(len(encoded).to_bytes(8, "little") + encoded) + 8 + len(encoded)
    return at + 4, int.from_bytes(data[at : at + 4], "little")


def set_dims(data: bytearray, name: str, dims: list[int]) -> None:
    """Tensor ``name``'s dims, fastest first (GGUF's ne order)."""
    at, count = _info_at(data, name)
    assert len(dims) == count
    for i, dim in enumerate(dims):
        data[at + 8 * i : at + 8 * i + 8] = dim.to_bytes(8, "little")


def offset_field(data: bytearray, name: str) -> slice:
    """The bytes of tensor ``name``'s data offset in the header."""
    at, count = _info_at(data, name)
    return slice(at + 8 * count + 4, at + 8 * count + 12)


def table_start(path: Path, name: str) -> int:
    """Where tensor ``name``'s table starts in the file."""
    reader = gguf.GGUFReader(path)
    return next(int(t.data_offset) for t in reader.tensors if t.name == name)
