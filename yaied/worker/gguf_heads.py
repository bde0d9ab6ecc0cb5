"""A GGUF file's attention heads: counts and size read from its metadata, checked against each
other and against the tensors' shapes before anything is converted (gguf_convert.py).

The q and k weights alone cannot catch counts that are wrong together (8 heads of 8 where the
model has 4 of 16 give the same rows), so what else fixes them is checked too: KV heads serve
whole groups of query heads; without ``key_length`` a head is ``embedding_length / head_count``
wide, as llama.cpp reads it; per-head norms (Qwen3's q_norm, k_norm) are one head wide; RoPE
turns pairs of dimensions, so a head is even. Each error is one line naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf

from yaied.worker.gguf_reader import metadata, required_metadata


@dataclass(frozen=True, slots=True)
class Heads:
    num_heads: int
    num_kv_heads: int
    head_dim: int


def count(reader: gguf.GGUFReader, key: str, default: int) -> int:
    """Metadata ``key`` (``default`` where absent) as a count of at least 1; a ValueError naming
    the field for anything else (0, a negative number, a list of per-layer counts)."""
    value = metadata(reader, key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"GGUF metadata {key} = {value!r}: yaied needs one count of at least 1")
    return value


def read_heads(reader: gguf.GGUFReader, arch: str, shapes: dict[str, list[int]]) -> Heads:
    """The heads of ``arch``'s attention; ``shapes``: each tensor's [rows, columns]."""
    q_rows, k_rows = shapes["blk.0.attn_q.weight"][0], shapes["blk.0.attn_k.weight"][0]
    hidden = shapes["token_embd.weight"][1]
    heads_key, kv_key = f"{arch}.attention.head_count", f"{arch}.attention.head_count_kv"
    size_key, width_key = f"{arch}.attention.key_length", f"{arch}.embedding_length"
    width = count(reader, width_key, hidden)
    if width != hidden:
        raise ValueError(
            f"GGUF metadata {width_key} = {width}, but token_embd.weight has {hidden} columns: "
            "corrupt metadata or tensors"
        )
    num_heads = count(reader, heads_key, required_metadata(reader, heads_key))
    num_kv_heads = count(reader, kv_key, num_heads)
    # key_length is the only reliable head size (Qwen3 has head_dim != hidden / heads).
    head_dim = count(reader, size_key, max(1, q_rows // num_heads))
    if num_heads * head_dim != q_rows or num_kv_heads * head_dim != k_rows:
        raise ValueError(
            f"GGUF metadata {heads_key} = {num_heads}, head_count_kv = {num_kv_heads} and "
            f"key_length = {head_dim} (given or implied) make q {num_heads * head_dim} and k "
            f"{num_kv_heads * head_dim} rows, but blk.0.attn_q.weight has {q_rows} and "
            f"blk.0.attn_k.weight {k_rows}: corrupt metadata or tensors"
        )
    if num_heads % num_kv_heads:
        raise ValueError(
            f"GGUF metadata {kv_key} = {num_kv_heads} does not divide {heads_key} = "
            f"{num_heads}: each KV head serves a whole group of query heads"
        )
    if metadata(reader, size_key) is None and num_heads * head_dim != hidden:
        raise ValueError(
            f"GGUF metadata {heads_key} = {num_heads} makes heads {hidden / num_heads:g} wide "
            f"({width_key} = {hidden} / {num_heads}, as llama.cpp reads a file without "
            f"{size_key}), but blk.0.attn_q.weight's {q_rows} rows make them {head_dim}: "
            f"corrupt metadata, or a file that needs {size_key}"
        )
    for name in (f"blk.0.attn_{x}_norm.weight" for x in "qk"):
        if name in shapes and shapes[name][0] != head_dim:
            raise ValueError(
                f"GGUF metadata {size_key} = {head_dim} (given or implied), but {name} has "
                f"{shapes[name][0]} values, one per dimension of a head: wrong head counts"
            )
    if head_dim % 2:
        raise ValueError(
            f"GGUF metadata {size_key} = {head_dim} (given or implied): RoPE turns pairs of "
            "dimensions, so a head must be even"
        )
    return Heads(num_heads, num_kv_heads, head_dim)
