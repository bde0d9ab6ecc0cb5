"""A GGUF file's block tables for the projections ``model.quantization = gguf`` keeps
(worker/quantized.py), read before the float weights are loaded, so that the weights they replace
are never read: a 1B model's projections are 4 GB in fp32, which the load held at its peak (with
the file's pages, over 8 GB for a 606 MB Q4_0 file) only to drop them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from yaied.kernels.cpu_quant import BY_GGML_ID, QuantType, check_table
from yaied.worker.gguf_convert import unpermute_rotary
from yaied.worker.gguf_reader import open_gguf
from yaied.worker.quantized import PARTS


def replaced_weights(model: nn.Module, tables: dict[str, Any]) -> set[str]:
    """The checkpoint (Hugging Face) names of the float weights that quantize_model replaces by
    ``tables``' blocks: what the load need not read (LlamaForCausalLM.load_weights' ``absent``).
    A projection that stays float (a type without a kernel) is not among them."""
    fused = getattr(model, "FUSED", {})
    names: set[str] = set()
    for key, found in tables.items():
        if not key.startswith("layers.") or isinstance(found, str):
            continue
        parent, _, child = key.rpartition(".")
        parts = [hf for hf, (target, _) in fused.items() if target == child] or [child]
        names.update(f"model.{parent}.{part}.weight" for part in parts)
    head = getattr(model, "lm_head", None)
    if "lm_head" in tables and isinstance(head, nn.Linear):
        if head.weight is not model.embed_tokens.weight:
            names.add("lm_head.weight")
        elif tables.get("lm_head_is_embedding"):  # the embeddings read the head's blocks
            names.add("model.embed_tokens.weight")
    return names


def read_tables(model: nn.Module, gguf_path: Path | None) -> dict[str, Any]:
    """Per projection of the model: its parts [(type, block table [rows, row bytes])] read from
    the file (one, or one per run of its tensors of one type), or a string naming why it stays
    float ("blk.3.ffn_down.weight (q5_0)"). A block table whose size does not match its tensor's
    shape stops the load with a ValueError naming the tensor. Also "lm_head": (type, table)
    where the head is of a kept type, and "lm_head_is_embedding": whether the file ties it."""
    if gguf_path is None:
        raise ValueError("model.quantization = gguf needs a .gguf model file")
    reader = open_gguf(gguf_path)
    field = reader.get_field("general.architecture")
    arch = field.contents() if field is not None else ""
    tensors = {t.name: t for t in reader.tensors}
    shape = model.shape
    heads = {"attn_q": shape.num_heads, "attn_k": shape.num_kv_heads}
    tables: dict = {}
    for index, layer in enumerate(model.layers):
        for name, parts in PARTS.items():
            linear = layer.get_submodule(name)
            k = linear.in_features
            pieces, types = [], set()
            for part in parts:
                tensor_name = f"blk.{index}.{part}.weight"
                tensor = tensors.get(tensor_name)
                if tensor is None:
                    raise ValueError(f"GGUF file {gguf_path} lacks {tensor_name}")
                qtype = BY_GGML_ID.get(int(tensor.tensor_type))
                types.add(qtype.name if qtype else tensor.tensor_type.name.lower())
                pieces.append((tensor_name, tensor, qtype))
            if any(piece[2] is None for piece in pieces):
                names = "+".join(p[0] for p in pieces)
                tables[f"layers.{index}.{name}"] = f"{names} ({'/'.join(sorted(types))})"
                continue
            blocks = []
            for tensor_name, tensor, qtype in pieces:
                rows = int(tensor.shape[1]) if len(tensor.shape) > 1 else 1
                if int(tensor.shape[0]) != k:
                    raise ValueError(
                        f"{tensor_name}: {int(tensor.shape[0])} columns, the model expects {k}"
                    )
                table = tensor.data.reshape(-1).view(np.uint8)  # a view of the file's mapping
                expected = rows * (k // qtype.block_size) * qtype.block_bytes
                if table.size != expected or k % qtype.block_size:
                    raise ValueError(
                        f"{tensor_name}: the {qtype.name} block table holds {table.size} "
                        f"bytes, a [{rows}, {k}] weight needs {expected}: truncated or corrupt"
                    )
                table = table.reshape(rows, -1)
                part = tensor_name.split(".")[2]
                if arch == "llama" and part in heads:
                    table = unpermute_rotary(table, heads[part])
                blocks.append(table)
            runs: list[tuple[QuantType, list[np.ndarray]]] = []  # tensors of one type in a row
            for (_, _, qtype), table in zip(pieces, blocks, strict=True):
                if runs and runs[-1][0] is qtype:
                    runs[-1][1].append(table)
                else:
                    runs.append((qtype, [table]))
            # one copy a run, straight from the file's mapping (which can then close): each
            # transient copy is a hole in the heap once freed
            found = [(qtype, torch.from_numpy(np.concatenate(run))) for qtype, run in runs]
            if sum(table.shape[0] for _, table in found) != linear.out_features:
                raise ValueError(
                    f"blk.{index}.{'+'.join(parts)}: rows do not make the model's "
                    f"{linear.out_features}: corrupt tensors"
                )
            tables[f"layers.{index}.{name}"] = found
    head = tensors.get("output.weight") or tensors.get("token_embd.weight")
    tables["lm_head_is_embedding"] = "output.weight" not in tensors
    qtype = BY_GGML_ID.get(int(head.tensor_type)) if head is not None else None
    if qtype is not None and isinstance(getattr(model, "lm_head", None), nn.Linear):
        linear = model.lm_head
        table = torch.from_numpy(head.data.reshape(-1).copy())
        expected = linear.out_features * (linear.in_features // qtype.block_size)
        if table.numel() == expected * qtype.block_bytes:
            table = table.view(linear.out_features, -1)
            check_table(qtype, table, linear.out_features, linear.in_features, head.name)
            tables["lm_head"] = (qtype, table)
    return tables
