"""Launcher for the decoder-layer loop (cpu_decode_loop.c): every layer of a decode step of a few
rows in one C call, over the few-row linear kernel and the decode step kernel, which the caller
hands over (``BoundLinear.address``, ``CpuDecodeKernel.step_address``). Its torch reference is
the same layers run one call at a time (yaied/worker/models/llama.py). Linear weights are bf16
(or, for cpu_quant.c's entry, a quantized weight's int64 descriptor; for cpu_matmul.c's, fp32
panels);
the activations, norms, biases and KV pools are bf16 or fp32 (fp32 math over bf16 weights)."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import NamedTuple

import torch

from yaied.kernels.cpu_build import KernelLibrary, load_library

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
_WEIGHTS = frozenset({"qkv_w", "o_w", "gate_up_w", "down_w"})  # bf16 whatever the activations
# (activations, KV pools) -> entry suffix: bf16 pools under fp32 math too (``cache.kv_cache_dtype``)
_SUFFIX = {
    (torch.bfloat16, torch.bfloat16): "bf16",
    (torch.float32, torch.float32): "f32",
    (torch.float32, torch.bfloat16): "f32_kv_bf16",
}


class _Layer(ctypes.Structure):
    _fields_ = [(name, _P) for name in _LAYER_FIELDS]


class LayerTensors(NamedTuple):
    """One decoder layer's tensors (contiguous; biases may be None) and its KV pools: linear
    weights bf16, the pools in theirs, the rest in the activations' dtype."""

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

    def __init__(self, library: KernelLibrary) -> None:
        self.level = library.level
        self._runs = {}
        for dtypes, suffix in _SUFFIX.items():
            run = getattr(library.cdll, f"decode_layers_{suffix}")
            run.argtypes = [_P, _P, _P, _I, _P, _P] + [_I] * 6 + [_F] + [_P] * 5
            run.argtypes += [_I, _I, _I, _F, _I]
            run.restype = ctypes.c_int
            self._runs[dtypes] = run

    @classmethod
    def load(
        cls, level: str | None = None, cache_dir: Path | None = None, *, strict: bool = False
    ) -> CpuDecodeLoop | None:
        library = load_library(SOURCE, level, cache_dir, strict=strict)
        return None if library is None else cls(library)

    @staticmethod
    def supports(dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> bool:
        return (dtype, kv_dtype or dtype) in _SUFFIX

    @staticmethod
    def layers(tensors: list[LayerTensors], dtype: torch.dtype) -> ctypes.Array:
        """The layers' pointers, once: the caller keeps the tensors alive while it uses them.
        ``dtype``: the activations' (the pools may be bf16 under fp32: ``supports``)."""
        array = (_Layer * len(tensors))()
        for entry, layer in zip(array, tensors, strict=True):
            for name, tensor in zip(_LAYER_FIELDS, layer, strict=True):
                if tensor is None:
                    continue
                want = torch.bfloat16 if name in _WEIGHTS else dtype
                if name in ("k_cache", "v_cache") and (dtype, layer.k_cache.dtype) in _SUFFIX:
                    want = layer.k_cache.dtype  # both pools alike, of a type the loop takes
                if name in _WEIGHTS and tensor.dtype == torch.int64 and tensor.dim() == 1:
                    want = torch.int64  # a quantized weight's descriptor (cpu_quant.py)
                if name in _WEIGHTS and tensor.dtype == torch.float32 and tensor.dim() == 3:
                    want = torch.float32  # the panel matmul's panels (cpu_matmul.py)
                if tensor.dtype != want or not tensor.is_contiguous():
                    raise ValueError(f"the decode loop takes contiguous {want} for {name}")
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
        kv_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """Run every layer over x [rows, hidden] (the residual stream, updated in place); returns
        the last layer's output, not yet added. ``linear`` and ``step``: the kernels' addresses.
        cos, sin: [rows, head_dim / 2] fp32; slots, context_lens: [rows], page_table:
        [rows, max_pages], int64, all contiguous (the runner builds them so). ``kv_dtype``: the
        pools' (default the activations'; ``layers`` checked them)."""
        rows = x.shape[0]
        run = self._runs.get((x.dtype, kv_dtype or x.dtype))
        if run is None or not x.is_contiguous() or x.shape[1] != shape.hidden:
            raise ValueError("the decode loop takes a contiguous [rows, hidden] input")
        if cos.shape != (rows, shape.head_dim // 2) or page_table.shape[0] != rows:
            raise ValueError("the step's tables do not match its rows")
        delta = torch.empty_like(x)
        status = run(
            linear, step, layers, len(layers), x.data_ptr(), delta.data_ptr(), rows,
            shape.hidden, shape.intermediate, shape.heads, shape.kv_heads, shape.head_dim,
            shape.eps, cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), page_table.data_ptr(),
            context_lens.data_ptr(), num_pages, page_size, page_table.shape[1], shape.scale,
            torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"the decode loop failed (status {status})")
        return delta
