"""Launcher for the few-row bf16 linear kernel (cpu_gemv.c), whose torch reference is F.linear.

A decode step at batch 1 to 4 is a pass over every weight; the kernel streams each weight once
at near the memory bandwidth, where oneDNN's packed linear reaches about half of it on small
layers (docs/benchmarks.md). yaied.worker.cpu_linear.PackedLinear binds it to each weight
(``few_rows``) and the decode loop (cpu_decode_loop.c) calls it through its address; everything
else keeps oneDNN. The launcher checks only what the C side relies on.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from yaied.kernels.cpu_build import load_library

SOURCE = Path(__file__).with_name("cpu_gemv.c")
MAX_ROWS = 4  # as in cpu_gemv.c


class CpuGemv:
    """The compiled kernel; ``CpuGemv.load()`` returns None where it cannot be built."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._linear = library.few_rows_linear
        self._linear.argtypes = [_P, _P, _P, ctypes.c_float] + [_P] * 4 + [_I] * 5
        self._linear.restype = ctypes.c_int
        native = library.gemv_native_bf16
        native.restype = ctypes.c_int
        # Built with the CPU's AVX512-BF16 dot products; the plain-C build is correct but no
        # faster than oneDNN, so callers use it only when asked to (tests).
        self.native = bool(native())

    @classmethod
    def load(cls, cache_dir: Path | None = None) -> CpuGemv | None:
        library = load_library(SOURCE, cache_dir)
        return None if library is None else cls(library)

    def bind(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> BoundLinear:
        """The kernel for one linear layer: weight [N, K] bf16 contiguous, bias [N] or None.
        The caller keeps weight and bias alive for as long as it uses the result."""
        return BoundLinear(self._linear, weight, bias)

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x @ weight.T + bias in one call (tests, and callers with a weight of the moment)."""
        return self.bind(weight.contiguous(), bias)(x)


class BoundLinear:
    """One linear layer's few-row kernel, the weight's checks and pointers taken once: it runs
    four times a layer, and checks only what changes from call to call."""

    __slots__ = ("function", "_weight", "_bias", "out_features", "in_features")

    def __init__(self, function, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        n, k = weight.shape
        if weight.dtype != torch.bfloat16 or not weight.is_contiguous():
            raise ValueError("the few-row linear kernel takes a contiguous bf16 weight")
        if bias is not None and (
            bias.shape != (n,) or bias.dtype != torch.bfloat16 or not bias.is_contiguous()
        ):
            raise ValueError(f"bad bias for a weight of {n} rows")
        self.function = function  # few_rows_linear (cpu_decode_loop.c calls it too)
        self._weight = weight.data_ptr()
        self._bias = None if bias is None else bias.data_ptr()
        self.out_features, self.in_features = n, k

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows <= MAX_ROWS, K] bf16 -> x @ weight.T + bias, [rows, N]."""
        rows, n, k = x.shape[0], self.out_features, self.in_features
        if x.dtype != torch.bfloat16 or x.shape[1] != k or not 1 <= rows <= MAX_ROWS:
            raise ValueError(f"bad input {tuple(x.shape)} {x.dtype} for weight [{n}, {k}]")
        x = x.contiguous()
        out = torch.empty((rows, n), dtype=torch.bfloat16)
        self.function(
            None, None, None, 0.0, x.data_ptr(), self._weight, self._bias, out.data_ptr(),
            rows, n, k, 0, _threads(),
        )  # fmt: skip
        return out

    def normed(
        self,
        delta: torch.Tensor | None,
        residual: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        silu: bool = False,
    ) -> torch.Tensor:
        """residual += delta in place (when given), then the layer over norm_weight *
        rms_norm(residual) (CpuFusedOps.add_rms_norm's numerics); with silu, SiLU-and-multiply
        of the result's two halves. residual, delta: [rows <= MAX_ROWS, K] bf16 contiguous."""
        rows, n, k = residual.shape[0], self.out_features, self.in_features
        if residual.dtype != torch.bfloat16 or residual.shape[1] != k:
            raise ValueError(f"bad residual {tuple(residual.shape)} for weight [{n}, {k}]")
        if not 1 <= rows <= MAX_ROWS or not residual.is_contiguous():
            raise ValueError(f"bad residual {tuple(residual.shape)} for weight [{n}, {k}]")
        if norm_weight.shape != (k,) or norm_weight.dtype != torch.bfloat16:
            raise ValueError(f"bad norm weight for weight [{n}, {k}]")
        if delta is not None:
            if delta.shape != residual.shape or delta.dtype != torch.bfloat16:
                raise ValueError("delta and residual differ")
            delta = delta.contiguous()
        out = torch.empty((rows, n // 2 if silu else n), dtype=torch.bfloat16)
        status = self.function(
            None if delta is None else delta.data_ptr(), residual.data_ptr(),
            norm_weight.data_ptr(), eps, None, self._weight, self._bias, out.data_ptr(),
            rows, n, k, int(silu), _threads(),
        )  # fmt: skip
        if status != 0:
            raise MemoryError("the few-row linear kernel could not get scratch memory")
        return out


_P, _I = ctypes.c_void_p, ctypes.c_int64
_threads = torch.get_num_threads
