"""Launcher for the many-row fp32 linear kernel (cpu_matmul.c), whose torch reference is
F.linear over the same fp32 weight.

Under fp32 math over bf16 weights (yaied/worker/cpu_linear.py) this runs every linear layer's
matmul of more rows than the few-row kernel takes, over the weight's fp32 values laid out in
panels once at load time (``pack_panels``); it replaces oneDNN's packed fp32 copy, as fast at
hundreds of rows and faster at tens (docs/benchmarks.md). Built at every level for the tests;
used from avx2 up (``fast``): the generic C body is slower than oneDNN.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
import torch.nn.functional as F

from yaied.kernels.cpu_build import KernelLibrary, load_library
from yaied.kernels.cpu_isa import level_rank

SOURCE = Path(__file__).with_name("cpu_matmul.c")
_P, _I = ctypes.c_void_p, ctypes.c_int64


class CpuMatmul:
    """The compiled kernel at one ISA level; ``CpuMatmul.load()`` returns None where it cannot
    be built."""

    def __init__(self, library: KernelLibrary) -> None:
        self.level = library.level
        self.width = int(library.cdll.matmul_panel_width())  # output columns per panel
        self._function = library.cdll.panel_linear_f32
        self._function.argtypes = [_P] * 4 + [_I] * 4
        self._function.restype = ctypes.c_int
        # The same with the layer's neighbours, in the few-row kernel's signature: the decode
        # loop's entry for steps of more rows than that kernel takes
        self.rows_function = library.cdll.panel_rows_linear_f32
        self.rows_function.argtypes = [_P, _P, _P, ctypes.c_float] + [_P] * 4 + [_I] * 5
        self.rows_function.restype = ctypes.c_int

    @property
    def rows_address(self) -> int:
        """panel_rows_linear_f32's address, for the decode loop (cpu_decode_loop.c)."""
        return ctypes.cast(self.rows_function, ctypes.c_void_p).value

    @property
    def fast(self) -> bool:
        """Whether this build beats oneDNN's fp32 matmul (its vector bodies: avx2 and up)."""
        return level_rank(self.level) >= level_rank("avx2")

    @classmethod
    def load(
        cls, level: str | None = None, cache_dir: Path | None = None, *, strict: bool = False
    ) -> CpuMatmul | None:
        library = load_library(SOURCE, level, cache_dir, strict=strict)
        return None if library is None else cls(library)

    def bind(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> BoundPanels:
        """The kernel for one linear layer: weight [N, K] (its values as fp32: a bf16 weight
        is widened exactly), bias [N] fp32 or None. Holds its own copy of the weight."""
        return BoundPanels(self, weight, bias)

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x @ weight.T + bias in one call (tests, and callers with a weight of the moment)."""
        return self.bind(weight, bias)(x)


def pack_panels(weight: torch.Tensor, width: int) -> torch.Tensor:
    """weight [N, K] as fp32 panels [ceil(N / width), K, width], zero past N (cpu_matmul.c)."""
    n, k = weight.shape
    padded = F.pad(weight.float(), (0, 0, 0, -n % width))
    return padded.view(-1, width, k).transpose(1, 2).contiguous()


class BoundPanels:
    """One linear layer's panels and bias, checked once; called with x [rows, K] fp32."""

    __slots__ = ("_kernel", "panels", "bias", "out_features", "in_features")

    def __init__(self, kernel: CpuMatmul, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        if weight.dim() != 2 or not weight.dtype.is_floating_point:
            raise ValueError("the panel matmul takes a floating-point weight [N, K]")
        n, k = weight.shape
        if bias is not None and (
            bias.shape != (n,) or bias.dtype != torch.float32 or not bias.is_contiguous()
        ):
            raise ValueError(f"bad bias for a weight of {n} rows: fp32 [{n}] expected")
        self._kernel = kernel
        self.panels = pack_panels(weight, kernel.width)
        self.bias = bias
        self.out_features, self.in_features = n, k

    @property
    def address(self) -> int:
        """The entry the decode loop calls for this layer (with ``panels`` as its weight)."""
        return self._kernel.rows_address

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, K] fp32 (rows may be 0) -> x @ weight.T + bias, [rows, N]."""
        n, k = self.out_features, self.in_features
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k:
            raise ValueError(f"bad input {tuple(x.shape)} {x.dtype} for weight [{n}, {k}]")
        rows = x.shape[0]
        out = torch.empty((rows, n), dtype=torch.float32)
        if rows == 0:
            return out
        x = x.contiguous()
        bias = None if self.bias is None else self.bias.data_ptr()
        status = self._kernel._function(
            x.data_ptr(), self.panels.data_ptr(), bias, out.data_ptr(), rows, n, k,
            torch.get_num_threads(),
        )  # fmt: skip
        _check(status)
        return out

    def normed(
        self,
        delta: torch.Tensor | None,
        residual: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        silu: bool = False,
    ) -> torch.Tensor:
        """As the decode loop runs it: residual += delta in place (when given), then the layer
        over norm_weight * rms_norm(residual); with silu, SiLU-and-multiply of the result's two
        halves (BoundLinear.normed's numerics). residual, delta: [rows, K] fp32 contiguous."""
        rows, n, k = residual.shape[0], self.out_features, self.in_features
        if residual.dtype != torch.float32 or residual.dim() != 2 or residual.shape[1] != k:
            raise ValueError(f"bad residual {tuple(residual.shape)} for weight [{n}, {k}]")
        if rows < 1 or not residual.is_contiguous() or norm_weight.shape != (k,):
            raise ValueError(f"bad residual or norm weight for weight [{n}, {k}]")
        if delta is not None and (delta.shape != residual.shape or delta.dtype != torch.float32):
            raise ValueError("delta and residual differ")
        if silu and n % 2:
            raise ValueError("SiLU-and-multiply takes an even width")
        delta = None if delta is None else delta.contiguous()
        norm_weight = norm_weight.float().contiguous()
        out = torch.empty((rows, n // 2 if silu else n), dtype=torch.float32)
        status = self._kernel.rows_function(
            None if delta is None else delta.data_ptr(), residual.data_ptr(),
            norm_weight.data_ptr(), eps, None, self.panels.data_ptr(),
            None if self.bias is None else self.bias.data_ptr(), out.data_ptr(), rows, n, k,
            int(silu), torch.get_num_threads(),
        )  # fmt: skip
        _check(status)
        return out


def _check(status: int) -> None:
    if status == -2:
        raise MemoryError("the panel matmul could not get scratch memory")
    if status != 0:
        raise RuntimeError(f"the panel matmul refused its sizes (status {status})")
