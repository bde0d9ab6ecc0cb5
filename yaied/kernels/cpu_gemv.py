"""Launcher for the few-row linear kernel over bf16 weights (cpu_gemv.c), whose torch reference
is F.linear.

A decode step of a few rows is a pass over every weight; the kernel streams each weight once
at near the memory bandwidth, where oneDNN's packed linear reaches about half of it on small
layers (docs/benchmarks.md), and bf16 weights are half the bytes of fp32 ones. Its activations
are bf16 (bf16 models) or fp32 (fp32 math over bf16 weights, on CPUs without bf16 dot products:
yaied/worker/cpu_linear.py). The decode loop (cpu_decode_loop.c) calls it through its address;
the launcher checks only what the C side relies on.

The kernel reads its weight in a streaming layout (``pack_weight``): rows interleaved a cache
line at a time, so that a block of rows is one sequential read. ``bind`` makes that copy; the
caller keeps the plain weight only where something else needs it.

On a CPU with AMX tiles, bf16 activations run on them (cpu_gemv.c's AMX body, over the same
copy): inside the few-row entry for 1-8 rows, and through ``BoundLinear.amx`` for 9 to
``AMX_MAX_ROWS`` rows, where oneDNN's matmul is the slower.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
import torch.nn.functional as F

from yaied.kernels.cpu_build import KernelLibrary, load_library
from yaied.kernels.cpu_isa import level_rank

SOURCE = Path(__file__).with_name("cpu_gemv.c")
MAX_ROWS = 8  # as in cpu_gemv.c
# An LM head whose matmul must widen its weight on every call (a tied fp32 head reads the
# embedding's fp32 values, which MKL re-packs each time) takes the kernel in slices of MAX_ROWS
# up to this many rows, from avx2 up: the default model's head, 32 rows, 13.5 ms against 24
# (avx2, a Zen 4), 64 rows 27-32 against 34-38, 128 rows even at avx512. The generic body is
# slower than the matmul past MAX_ROWS (32 rows 102 ms against 28).
SLICED_MAX_ROWS = 64
# bf16 layers of MAX_ROWS + 1 to this many rows take the AMX body where the CPU has the tiles,
# in forward and in the decode loop (cpu_gemv.c's body takes up to 64): against oneDNN's AMX
# matmul over the default model's 30 layers, 16 rows 11-15 ms against 15-22, 32 rows 15-25
# against 16-36, and 48 or 64 rows no faster (docs/benchmarks.md).
AMX_MAX_ROWS = 32
GROUP, CHUNK = 8, 32  # the streaming layout's rows and elements per step, as in cpu_gemv.c
ACTIVATION_DTYPES = (torch.bfloat16, torch.float32)
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}


def slice_limit(level: str, dtype: torch.dtype, measured: int) -> int:
    """An LM head's row limit for a few-row kernel in slices: ``measured`` under fp32 math from
    avx2 up, else MAX_ROWS (the generic bodies, and bf16 math where oneDNN is the faster)."""
    fast = dtype == torch.float32 and level_rank(level) >= level_rank("avx2")
    return measured if fast else MAX_ROWS


class CpuGemv:
    """The compiled kernel at one ISA level; ``CpuGemv.load()`` returns None where it cannot be
    built."""

    def __init__(self, library: KernelLibrary) -> None:
        self.level = library.level
        self._functions = {}
        for dtype, suffix in _SUFFIX.items():
            function = getattr(library.cdll, f"few_rows_linear_{suffix}")
            function.argtypes = [_P, _P, _P, ctypes.c_float] + [_P] * 4 + [_I] * 5
            function.restype = ctypes.c_int
            self._functions[dtype] = function
        # The AMX body: where this build has it and Linux gives the process the tile state. It
        # also runs inside few_rows_linear_bf16, for every row count (cpu_gemv.c).
        self.amx = bool(library.cdll.gemv_amx_ready())
        self.amx_function = library.cdll.amx_linear_bf16
        self.amx_function.argtypes = [_P] * 4 + [_I] * 4
        self.amx_function.restype = ctypes.c_int
        self._use_amx = library.cdll.gemv_use_amx
        self._use_amx.argtypes = [_I]

    def use_amx(self, on: bool) -> bool:
        """Run bf16 layers on the AMX body (the default, where the tiles are) or, off, on the
        dot-product body, for every layer of this kernel library in the process (tests of
        that body on a CPU with tiles). Returns whether the AMX body is now used."""
        used = bool(self._use_amx(int(on)))
        self.amx = used
        return used

    def sliced_max_rows(self, dtype: torch.dtype) -> int:
        """Up to how many rows of ``dtype`` activations an LM head without a packed matmul
        weight takes the kernel (``BoundLinear.in_slices``): measured for fp32 math."""
        return slice_limit(self.level, dtype, SLICED_MAX_ROWS)

    @classmethod
    def load(
        cls, level: str | None = None, cache_dir: Path | None = None, *, strict: bool = False
    ) -> CpuGemv | None:
        library = load_library(SOURCE, level, cache_dir, strict=strict)
        return None if library is None else cls(library)

    def bind(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> BoundLinear:
        """The kernel for one linear layer: weight [N, K] bf16, bias [N] (in the activations'
        ``dtype``) or None. The result holds the weight in the kernel's layout (its own copy);
        the caller keeps bias alive for as long as it uses it."""
        bound = BoundLinear(self._functions[dtype], dtype, weight, bias)
        if self.amx and dtype == torch.bfloat16:
            bound.amx_kernels = self
        return bound

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x @ weight.T + bias in one call (tests, and callers with a weight of the moment)."""
        return self.bind(weight, bias, x.dtype)(x)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] in the kernel's streaming layout: zero-padded to multiples of GROUP rows
    and CHUNK columns, then [N / GROUP, K / CHUNK, GROUP, CHUNK] (cpu_gemv.c's header)."""
    n, k = weight.shape
    padded = F.pad(weight, (0, -k % CHUNK, 0, -n % GROUP))
    rows, cols = padded.shape
    return padded.view(rows // GROUP, GROUP, cols // CHUNK, CHUNK).transpose(1, 2).contiguous()


def unpack_weight(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The [n, k] weight that ``pack_weight`` laid out (a copy)."""
    groups, chunks = packed.shape[:2]
    return packed.transpose(1, 2).reshape(groups * GROUP, chunks * CHUNK)[:n, :k].contiguous()


class BoundLinear:
    """One linear layer's few-row kernel, the weight's checks and pointers taken once: it runs
    four times a layer, and checks only what changes from call to call."""

    __slots__ = (
        "function", "dtype", "kernel_weight", "_weight", "_bias", "_bias_tensor", "out_features",
        "in_features", "amx_kernels",
    )  # fmt: skip

    def __init__(
        self, function, dtype: torch.dtype, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> None:
        if weight.dtype != torch.bfloat16 or weight.dim() != 2:
            raise ValueError("the few-row linear kernel takes a bf16 weight [N, K]")
        # What the C side takes as the weight (cpu_quant.py's subclass: its descriptor)
        self.kernel_weight = pack_weight(weight)
        self._bind(function, dtype, self.kernel_weight.data_ptr(), *weight.shape, bias)

    def _bind(
        self, function, dtype: torch.dtype, weight: int, n: int, k: int, bias: torch.Tensor | None
    ) -> None:
        """weight: what the C entry takes as the weight (an address; cpu_quant.py's subclass
        passes its block table's descriptor)."""
        if bias is not None and (
            bias.shape != (n,) or bias.dtype != dtype or not bias.is_contiguous()
        ):
            raise ValueError(f"bad bias for a weight of {n} rows")
        self.function = function  # few_rows_linear_<dtype> (cpu_decode_loop.c calls it too)
        self.dtype = dtype  # of the activations, the bias and the output
        self._weight = weight
        self._bias = None if bias is None else bias.data_ptr()
        self._bias_tensor = bias  # the address above stays valid while the layer lives
        self.out_features, self.in_features = n, k
        self.amx_kernels = None  # the CpuGemv whose AMX body runs 9-32 rows (where it has tiles)

    @property
    def address(self) -> int:
        """The kernel entry's address, for C callers (cpu_decode_loop.c)."""
        return ctypes.cast(self.function, ctypes.c_void_p).value

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows <= MAX_ROWS, K] -> x @ weight.T + bias, [rows, N]."""
        return self.in_slices(x, MAX_ROWS)

    def in_slices(self, x: torch.Tensor, max_rows: int | None = None) -> torch.Tensor:
        """x [rows (<= max_rows where given), K] -> [rows, N], MAX_ROWS rows a kernel call:
        each row's output is the same bits in any slice (an LM head's logits do not depend on
        which rows were sampled beside it)."""
        rows, n, k = x.shape[0], self.out_features, self.in_features
        too_many = max_rows is not None and rows > max_rows
        if x.dtype != self.dtype or x.dim() != 2 or x.shape[1] != k or rows < 1 or too_many:
            raise ValueError(f"bad input {tuple(x.shape)} {x.dtype} for weight [{n}, {k}]")
        x = x.contiguous()
        out = torch.empty((rows, n), dtype=self.dtype)
        size, threads = x.element_size(), _threads()
        for start in range(0, rows, MAX_ROWS):
            count = min(MAX_ROWS, rows - start)
            status = self.function(
                None, None, None, 0.0, x.data_ptr() + start * k * size, self._weight,
                self._bias, out.data_ptr() + start * n * size, count, n, k, 0, threads,
            )  # fmt: skip
            self._check(status)
        return out

    @property
    def max_rows(self) -> int:
        """The most rows one call of ``function`` takes: AMX_MAX_ROWS where bf16 layers run on
        the tiles (the decode loop then takes steps of that many rows), else MAX_ROWS."""
        on_tiles = self.amx_kernels is not None and self.amx_kernels.amx
        return AMX_MAX_ROWS if on_tiles else MAX_ROWS

    def amx_takes(self, x: torch.Tensor) -> bool:
        """Whether ``amx`` runs x: [MAX_ROWS < rows <= AMX_MAX_ROWS, K] bf16, with the tiles."""
        return (
            self.amx_kernels is not None
            and self.amx_kernels.amx
            and x.dim() == 2
            and MAX_ROWS < x.shape[0] <= AMX_MAX_ROWS
            and x.dtype == torch.bfloat16
            and x.shape[1] % 2 == 0
        )

    def amx(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, K] (``amx_takes``) -> x @ weight.T + bias, [rows, N], on the AMX tiles."""
        if not self.amx_takes(x) or x.shape[1] != self.in_features:
            raise ValueError(f"bad input {tuple(x.shape)} {x.dtype} for the AMX linear")
        x = x.contiguous()
        out = torch.empty((x.shape[0], self.out_features), dtype=torch.bfloat16)
        status = self.amx_kernels.amx_function(
            x.data_ptr(), self._weight, self._bias, out.data_ptr(), x.shape[0],
            self.out_features, self.in_features, _threads(),
        )  # fmt: skip
        if status == -1:  # CpuGemv.use_amx(False) on another handle of this library
            raise RuntimeError("the AMX body is off in this process")
        self._check(status)
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
        of the result's two halves. residual, delta: [rows <= MAX_ROWS, K] contiguous."""
        rows, n, k = residual.shape[0], self.out_features, self.in_features
        bad = f"bad residual {tuple(residual.shape)} {residual.dtype} for weight [{n}, {k}]"
        if residual.dtype != self.dtype or residual.shape[1] != k:
            raise ValueError(bad)
        if not 1 <= rows <= MAX_ROWS or not residual.is_contiguous():
            raise ValueError(bad)
        if norm_weight.shape != (k,) or norm_weight.dtype != self.dtype:
            raise ValueError(f"bad norm weight for weight [{n}, {k}]")
        if delta is not None:
            if delta.shape != residual.shape or delta.dtype != self.dtype:
                raise ValueError("delta and residual differ")
            delta = delta.contiguous()
        out = torch.empty((rows, n // 2 if silu else n), dtype=self.dtype)
        status = self.function(
            None if delta is None else delta.data_ptr(), residual.data_ptr(),
            norm_weight.data_ptr(), eps, None, self._weight, self._bias, out.data_ptr(),
            rows, n, k, int(silu), _threads(),
        )  # fmt: skip
        self._check(status)
        return out

    @staticmethod
    def _check(status: int) -> None:
        if status != 0:
            raise MemoryError("the few-row linear kernel could not get scratch memory")


_P, _I = ctypes.c_void_p, ctypes.c_int64
_threads = torch.get_num_threads
