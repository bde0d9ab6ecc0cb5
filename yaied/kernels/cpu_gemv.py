"""Launcher for the few-row bf16 linear kernel (cpu_gemv.c), whose torch reference is F.linear.

A decode step at batch 1 to 4 is a pass over every weight; the kernel streams each weight once
at near the memory bandwidth, where oneDNN's packed linear reaches about half of it on small
layers (docs/benchmarks.md). yaied.worker.cpu_linear.PackedLinear calls it for those rows and
keeps oneDNN for the rest. The launcher checks only what the C side relies on: it runs four
times per layer.
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
        self._linear = library.linear_bf16
        self._linear.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4
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

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x: [rows <= MAX_ROWS, K] bf16; weight: [N, K] bf16 contiguous; bias: [N] or None.
        Returns x @ weight.T + bias, [rows, N] bf16."""
        rows, k = x.shape
        n = weight.shape[0]
        if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
            raise ValueError("the few-row linear kernel takes bf16")
        if weight.shape[1] != k or not 1 <= rows <= MAX_ROWS:
            raise ValueError(f"bad shapes: x {tuple(x.shape)}, weight {tuple(weight.shape)}")
        x = x.contiguous()
        out = torch.empty((rows, n), dtype=torch.bfloat16)
        self._linear(
            x.data_ptr(),
            weight.data_ptr(),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            rows,
            n,
            k,
            torch.get_num_threads(),
        )
        return out
