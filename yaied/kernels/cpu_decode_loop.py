"""Launcher for the decoder-layer loop (cpu_decode_loop.c): every layer of a decode step of a few
rows in one C call, over the few-row linear kernel and the decode step kernel, which the caller
hands over (``BoundLinear.function``, ``CpuDecodeKernel.step_function``). Its torch reference is
the same layers run one call at a time (yaied/worker/models/llama.py)."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import NamedTuple

import torch

from yaied.kernels.cpu_build import load_library

SOURCE = Path(__file__).with_name("cpu_decode_loop.c")
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_LAYER_FIELDS = (
    "input_norm",
    "post_norm",
    "qkv_w",
    "qkv_b",
    "o_w",
    "o_b",
    "gate_up_w",
    "gate_up_b",
    "down_w",
    "down_b",
    "k_cache",
    "v_cache",
)


class _Layer(ctypes.Structure):
    _fields_ = [(name, _P) for name in _LAYER_FIELDS]


class LayerTensors(NamedTuple):
    """One decoder layer's bf16 tensors (contiguous; biases may be None) and its KV pools."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor | None
    o_w: torch.Tensor
    o_b: torch.Tensor | None
    gate_up_w: torch.Tensor
    gate_up_b: torch.Tensor | None
    down_w: torch.Tensor
    down_b: torch.Tensor | None
    k_cache: torch.Tensor
    v_cache: torch.Tensor


class DecodeShape(NamedTuple):
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    scale: float


class CpuDecodeLoop:
    """The compiled loop; ``CpuDecodeLoop.load()`` returns None where it cannot be built."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._run = library.decode_layers_bf16
        self._run.argtypes = [_P, _P, _P, _I, _P, _P] + [_I] * 6 + [_F] + [_P] * 5
        self._run.argtypes += [_I, _I, _I, _F, _I]
        self._run.restype = ctypes.c_int

    @classmethod
    def load(cls, cache_dir: Path | None = None) -> CpuDecodeLoop | None:
        library = load_library(SOURCE, cache_dir)
        return None if library is None else cls(library)

    @staticmethod
    def layers(tensors: list[LayerTensors]) -> ctypes.Array:
        """The layers' pointers, once: the caller keeps the tensors alive while it uses them."""
        array = (_Layer * len(tensors))()
        for entry, layer in zip(array, tensors, strict=True):
            for name, tensor in zip(_LAYER_FIELDS, layer, strict=True):
                if tensor is None:
                    continue
                if tensor.dtype != torch.bfloat16 or not tensor.is_contiguous():
                    raise ValueError(f"the decode loop takes contiguous bf16 tensors ({name})")
                setattr(entry, name, tensor.data_ptr())
        return array

    def __call__(
        self,
        linear: int,
        step: int,
        layers: ctypes.Array,
        shape: DecodeShape,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        page_table: torch.Tensor,
        context_lens: torch.Tensor,
        num_pages: int,
        page_size: int,
    ) -> torch.Tensor:
        """Run every layer over x [rows, hidden] (the residual stream, updated in place); returns
        the last layer's output, not yet added. ``linear`` and ``step``: the kernels' addresses.
        cos, sin: [rows, head_dim / 2] fp32; slots, context_lens: [rows], page_table:
        [rows, max_pages], int64, all contiguous (the runner builds them so)."""
        rows = x.shape[0]
        if x.dtype != torch.bfloat16 or not x.is_contiguous() or x.shape[1] != shape.hidden:
            raise ValueError("the decode loop takes a contiguous bf16 [rows, hidden] input")
        if cos.shape != (rows, shape.head_dim // 2) or page_table.shape[0] != rows:
            raise ValueError("the step's tables do not match its rows")
        delta = torch.empty_like(x)
        status = self._run(
            linear, step, layers, len(layers), x.data_ptr(), delta.data_ptr(), rows,
            shape.hidden, shape.intermediate, shape.heads, shape.kv_heads, shape.head_dim,
            shape.eps, cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), page_table.data_ptr(),
            context_lens.data_ptr(), num_pages, page_size, page_table.shape[1], shape.scale,
            torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"the decode loop failed (status {status})")
        return delta
