"""Quantized linear weights on CPU (``model.quantization``): the decoder layers' projections kept
in GGUF's blocks (yaied/kernels/cpu_quant.py), taken from a GGUF file as they are (``gguf``) or
packed at load from float weights (``q8_0``, ``q4_0``). A merged projection whose GGUF tensors
differ in type (a Q4_K_M file's q/k/v with V in Q6_K) keeps each run of one type in its own table
(``QuantizedLinear.stacked``), one kernel call with a descriptor of the parts.

What stays in higher precision: the token embeddings (a step reads one row of them), every norm
and the biases, in the math dtype. The LM head, a large share of a small model's decode bytes,
is quantized too: in the file's type of ``output.weight`` (or of ``token_embd.weight`` when the
head is tied to it) under ``gguf``, where yaied has a kernel for it, else left as unquantized
models have it; Q8_0 under ``q8_0`` and ``q4_0``.

On the token's path: a decode step of a few rows runs the decode loop (models/decode_loop.py)
over the few-row quantized kernel, which reads the blocks; every other forward (prefill, large
batches, speculative verification) unpacks the weight a tile of rows at a time into one reused
buffer in the math dtype and runs the matmul of each tile there (``QuantizedLinear.forward``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from yaied.kernels.cpu_quant import (
    GROUPED,
    MAX_ROWS,
    Q8_0,
    QUANT_TYPES,
    CpuQuant,
    QuantType,
    check_table,
    dequantize_reference,
    group_blocks,
    quantize,
)
from yaied.worker.onednn_rows import pad_rows

log = logging.getLogger(__name__)

# The projections of a native decoder layer that are quantized, and the GGUF tensors each is
# made of (in row order).
PARTS = {
    "self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
}


# A matmul of many rows unpacks this many bytes of weight rows at a time. Measured on a
# 1B-shaped Q4_0 layer (16384 x 2048, 512 rows of activations, 2 threads, Zen 4): fp32 math
# (the avx2 level) ran 240-250 ms in tiles of 8 MB against 300-310 ms for the whole weight
# (the tile stays in cache between its unpacking and its matmul), bf16 math 92-95 against
# 90-93 ms; the float copy then costs 8 MB, not the largest layer (67 MB there in bf16,
# 134 MB in fp32, and the LM head's 200 MB when prompt logprobs take it).
TILE_BYTES = 8 * 1024**2


class _UnpackBuffer:
    """One growing buffer per dtype for the weight rows being unpacked: a matmul of many rows
    needs one tile of one weight in float at a time."""

    buffers: dict[torch.dtype, torch.Tensor] = {}

    @classmethod
    def get(cls, dtype: torch.dtype, numel: int) -> torch.Tensor:
        buffer = cls.buffers.get(dtype)
        if buffer is None or buffer.numel() < numel:
            # a normal tensor, not an inference one, wherever it is first made: shared by
            # every caller, it takes writes in and out of the engine's inference mode
            with torch.inference_mode(False):
                buffer = cls.buffers[dtype] = torch.empty(numel, dtype=dtype)
        return buffer


def _kept(qtype: QuantType, blocks: torch.Tensor, k: int) -> tuple[QuantType, torch.Tensor]:
    """A checked table [rows, row bytes] of a [rows, k] weight, in the kernels' layout (Q4_0
    and Q4_1 regrouped: cpu_quant.py)."""
    check_table(qtype, blocks, blocks.shape[0], k, "weight")
    return group_blocks(qtype, blocks) if qtype in GROUPED else (qtype, blocks)


class QuantizedLinear(nn.Module):
    """Drop-in for a linear layer whose weight is a block table, or (``stacked``) tables of
    different types for its runs of rows. ``few_rows`` (once ``bind`` has run) is the kernel
    over the blocks, with BoundLinear's interface, for the decode loop; forward unpacks the
    weight for the matmul. ``qtype`` and ``blocks`` are the first part's: the whole table of a
    one-part weight (the LM head, whose rows the tied embeddings read)."""

    def __init__(
        self, qtype: QuantType, blocks: torch.Tensor, in_features: int, bias: torch.Tensor | None
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, blocks.shape[0]
        self.parts = [_kept(qtype, blocks, in_features)]
        self.qtype, self.blocks = self.parts[0]
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.kernel: CpuQuant | None = None
        self.few_rows = None
        self.sliced_max_rows = MAX_ROWS
        # The LM head takes the kernel in forward too, in slices up to sliced_max_rows rows:
        # its rows are the sampled ones, one per sequence (prompt logprobs, more rows, unpack
        # the weight like any matmul).
        self.few_rows_in_forward = False

    def bind(self, kernel: CpuQuant | None, dtype: torch.dtype) -> None:
        """Use ``kernel`` (None: the torch reference) for activations of ``dtype``."""
        if self.bias is not None:
            self.bias = self.bias.to(dtype).contiguous()
        self.kernel = kernel
        self.few_rows = None
        self.sliced_max_rows = MAX_ROWS if kernel is None else kernel.sliced_max_rows(dtype)
        if kernel is not None:
            self.few_rows = kernel.bind_parts(self.parts, self.in_features, self.bias, dtype)

    @classmethod
    def stacked(
        cls,
        parts: list[tuple[QuantType, torch.Tensor]],
        in_features: int,
        bias: torch.Tensor | None,
    ) -> QuantizedLinear:
        """A weight whose rows are ``parts`` (type, table [rows, row bytes]) in order."""
        module = cls(*parts[0], in_features, bias)
        module.parts += [_kept(qtype, blocks, in_features) for qtype, blocks in parts[1:]]
        module.out_features = sum(blocks.shape[0] for _, blocks in module.parts)
        return module

    def unpacked(self, dtype: torch.dtype, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Weight rows [start, stop) in ``dtype``, in the shared buffer (valid until the next
        call), each part's rows unpacked after the last's."""
        stop, k = (self.out_features if stop is None else stop), self.in_features
        buffer = _UnpackBuffer.get(dtype, (stop - start) * k)
        first = 0
        for qtype, blocks in self.parts:
            low, high = max(start, first), min(stop, first + blocks.shape[0])
            if low < high:
                rows, at = blocks[low - first : high - first], buffer[(low - start) * k :]
                if self.kernel is None:
                    at[: (high - low) * k] = dequantize_reference(qtype, rows, k).flatten()
                else:
                    self.kernel.dequantize(qtype, rows, k, dtype, at)
            first += blocks.shape[0]
        return buffer[: (stop - start) * k].view(stop - start, k)

    def tile_rows(self, itemsize: int) -> int:
        """Weight rows a matmul in a dtype of ``itemsize`` bytes unpacks at a time (a multiple
        of 64, or all of them)."""
        rows = max(64, TILE_BYTES // (self.in_features * itemsize) // 64 * 64)
        return min(rows, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        few_rows = self.few_rows
        if (
            self.few_rows_in_forward
            and few_rows is not None
            and x.dim() == 2
            and 1 <= x.shape[0] <= self.sliced_max_rows
            and x.dtype == few_rows.dtype
        ):
            return few_rows.in_slices(x)
        bias = self.bias
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        flat = x.reshape(-1, self.in_features)
        count = flat.shape[0]
        if x.dtype != torch.float32:  # oneDNN's matmul, a primitive per shape (onednn_rows.py)
            flat = pad_rows(flat)
        rows = self.tile_rows(x.element_size())
        if rows == self.out_features:
            out = F.linear(flat, self.unpacked(x.dtype), bias)
        else:
            out = self._tiled(flat, bias, rows)
        return out[:count].view(*x.shape[:-1], self.out_features)

    def _tiled(self, flat: torch.Tensor, bias: torch.Tensor | None, rows: int) -> torch.Tensor:
        # Tile by tile, each as F.linear computes a 2-D input (addmm: the bias added before
        # the result is rounded to the dtype). Each output is still one dot product over all
        # of K: on the layer shapes above the tiles gave the whole matmul's bits.
        out = flat.new_empty(flat.shape[0], self.out_features)
        for start in range(0, self.out_features, rows):
            stop = min(start + rows, self.out_features)
            tile = self.unpacked(flat.dtype, start, stop)
            if bias is None:
                out[:, start:stop] = torch.mm(flat, tile.t())
            else:
                out[:, start:stop] = torch.addmm(bias[start:stop], flat, tile.t())
        return out

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, {'+'.join(t.name for t, _ in self.parts)}"


class QuantizedEmbedding(nn.Module):
    """The token embeddings read from a tied LM head's block table: a lookup unpacks the rows
    it needs, so the embeddings cost no float copy. ``weight`` is an empty tensor that only
    carries the math dtype (``model.to(dtype)`` casts it), which the model reads."""

    def __init__(self, head: QuantizedLinear) -> None:
        super().__init__()
        self.head = [head]  # a list: not a submodule, so the model holds the head once
        self.register_buffer("weight", torch.empty(0), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        head = self.head[0]
        rows = head.blocks.index_select(0, ids.reshape(-1))
        if head.kernel is not None:
            values = head.kernel.dequantize(head.qtype, rows, head.in_features, torch.float32)
        else:
            values = dequantize_reference(head.qtype, rows, head.in_features)
        return values.to(self.weight.dtype).reshape(*ids.shape, head.in_features)


def resolve_quantization(setting: str, model: str, gguf_path: Path | None) -> str:
    """The quantization a model runs with: ``auto`` is ``gguf`` for a GGUF model, else none."""
    if setting == "auto":
        return "gguf" if gguf_path is not None else "none"
    if setting == "gguf" and gguf_path is None:
        raise ValueError(
            f"model.quantization = gguf keeps a GGUF file's blocks, but {model!r} is not a .gguf "
            "file: use q8_0 or q4_0 to pack its weights at load"
        )
    return setting


def quantize_model(model: nn.Module, mode: str, tables: dict[str, Any] | None = None) -> int:
    """Replace the decoder layers' projections of a native model by QuantizedLinear: from the
    GGUF file's blocks (``gguf``: ``tables``, gguf_tables.read_tables'; a projection with a part
    of a type without a kernel keeps the float weight, with one log line; parts of different
    types are stacked) or packed from the weights (``q8_0``, ``q4_0``). Returns how many were
    replaced."""
    layers = getattr(model, "layers", None)
    if layers is None:
        raise ValueError("quantized weights run on the native models only")
    if mode == "gguf" and tables is None:
        raise ValueError("model.quantization = gguf needs the GGUF file's block tables")
    tables = tables if mode == "gguf" else None
    kept: list[str] = []
    replaced = 0
    for index, layer in enumerate(layers):
        for name in PARTS:
            linear = layer.get_submodule(name)
            full_name = f"layers.{index}.{name}"
            if tables is not None:
                found = tables.pop(full_name)  # the table's last holder: Q4_0/Q4_1 regroup a copy
                if isinstance(found, str):
                    kept.append(found)
                    continue
            else:
                qtype = QUANT_TYPES[mode]
                _check_packable(mode, qtype, full_name, linear.in_features)
                found = [(qtype, quantize(linear.weight.detach(), qtype))]
            module = QuantizedLinear.stacked(found, linear.in_features, linear.bias)
            parent_name, _, child = name.rpartition(".")
            setattr(layer.get_submodule(parent_name), child, module)
            replaced += 1
    head = _quantized_head(model, mode, tables)
    if head is not None:
        tied = model.lm_head.weight is model.embed_tokens.weight
        model.lm_head = head
        replaced += 1
        if tied and (tables is None or tables.get("lm_head_is_embedding")):
            model.embed_tokens = QuantizedEmbedding(head)
    elif mode == "gguf":
        kept.append("the LM head")
    if kept:
        shown = ", ".join(kept[:4]) + (f" and {len(kept) - 4} more" if len(kept) > 4 else "")
        log.warning("GGUF weights without a quantized kernel, dequantized: %s", shown)
    return replaced


def _check_packable(mode: str, qtype: QuantType, name: str, k: int) -> None:
    if k % qtype.block_size:
        raise ValueError(
            f"model.quantization = {mode} packs rows in {qtype.name} blocks of "
            f"{qtype.block_size} weights, but {name}'s rows are {k} long: use none"
        )


def _quantized_head(model: nn.Module, mode: str, tables: dict | None) -> QuantizedLinear | None:
    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear):
        return None
    if tables is None:
        _check_packable(mode, Q8_0, "the LM head", head.in_features)
        qtype, blocks = Q8_0, quantize(head.weight.detach(), Q8_0)
    else:
        found = tables.pop("lm_head", None)
        if found is None:
            return None
        qtype, blocks = found
    module = QuantizedLinear(qtype, blocks, head.in_features, head.bias)
    module.few_rows_in_forward = True
    return module


def bind_quantized(model: nn.Module, kernel: CpuQuant | None, dtype: torch.dtype) -> int:
    """Bind every QuantizedLinear to the kernels (None: torch reference) for ``dtype``."""
    count = 0
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            module.bind(kernel, dtype)
            count += 1
    return count


def quantized_types(model: nn.Module) -> str:
    """The block types of the model's quantized layers ("q4_1", "q4_k+q8_0"), "" for none."""
    modules = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    names = {qtype.name for m in modules for qtype, _ in m.parts}
    return "+".join(sorted(names))
