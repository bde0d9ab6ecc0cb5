"""Launcher for the CPU paged decode-attention kernel (cpu_paged_decode.c).

The torch path (yaied.worker.attention._decode_attention) gathers every sequence's pages into a
padded copy and reads it again in two batched matmuls; on a CPU that is memory-bound work done
three times. The C kernel reads K/V once, straight from the pages. It is compiled on first use with
the system C compiler into the yaied cache folder and loaded with ctypes (no torch headers, so it
builds in about a second; yaied.kernels.cpu_build); where no compiler is found the engine keeps
the torch path.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from yaied.kernels.cpu_build import KernelLibrary, load_library

SOURCE = Path(__file__).with_name("cpu_paged_decode.c")
# (activations, KV pools) -> entry: bf16 pools under fp32 math too (``cache.kv_cache_dtype``)
_FUNCTIONS = {
    (torch.bfloat16, torch.bfloat16): "paged_decode_bf16",
    (torch.float32, torch.float32): "paged_decode_f32",
    (torch.float32, torch.bfloat16): "paged_decode_f32_kv_bf16",
}
_ARGTYPES = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 8 + [ctypes.c_float]
_P, _I = ctypes.c_void_p, ctypes.c_int64
_STEP_ARGTYPES = [_P, _I] + [_P] * 8 + [_I] * 7 + [ctypes.c_float]


class CpuDecodeKernel:
    """The compiled kernel; ``CpuDecodeKernel.load()`` returns None where it cannot be built."""

    def __init__(self, library: KernelLibrary) -> None:
        self.level = library.level
        self._functions = {}
        self._steps = {}
        for dtypes, name in _FUNCTIONS.items():
            function = getattr(library.cdll, name)
            function.argtypes = _ARGTYPES
            function.restype = ctypes.c_int
            self._functions[dtypes] = function
            step = getattr(library.cdll, f"{name}_step")
            step.argtypes = _STEP_ARGTYPES
            step.restype = ctypes.c_int
            self._steps[dtypes] = step

    @classmethod
    def load(
        cls, level: str | None = None, cache_dir: Path | None = None, *, strict: bool = False
    ) -> CpuDecodeKernel | None:
        library = load_library(SOURCE, level, cache_dir, strict=strict)
        return None if library is None else cls(library)

    def step_address(self, dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> int:
        """The step entry's address, for C callers (cpu_decode_loop.c); ``dtype`` the
        activations', ``kv_dtype`` the pools' (default the same)."""
        return ctypes.cast(self._steps[dtype, kv_dtype or dtype], ctypes.c_void_p).value

    def supports(
        self, dtype: torch.dtype, group: int, head_dim: int, kv_dtype: torch.dtype | None = None
    ) -> bool:
        return (dtype, kv_dtype or dtype) in self._functions and group <= 16 and head_dim <= 256

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        page_table: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """q: [rows, heads, head_dim]; caches: [kv_heads, num_pages, page_size, head_dim];
        page_table: [rows, max_pages] int64; context_lens: [rows] int64. Returns like q."""
        rows, heads, head_dim = q.shape
        kv_heads, _, _, cache_dim = k_cache.shape
        _check(q.device.type == "cpu", "the CPU kernel needs CPU tensors")
        _check(cache_dim == head_dim and heads % kv_heads == 0, "q and cache shapes disagree")
        _check(v_cache.shape == k_cache.shape, "k and v caches differ in shape")
        _check(v_cache.dtype == k_cache.dtype, "k and v caches differ in dtype")
        _check((q.dtype, k_cache.dtype) in self._functions, "no kernel for these dtypes")
        _check(page_table.dtype == context_lens.dtype == torch.int64, "indices must be int64")
        _check(page_table.shape[0] == rows and context_lens.shape == (rows,), "bad index shapes")
        q, page_table, context_lens = (t.contiguous() for t in (q, page_table, context_lens))
        _check(k_cache.is_contiguous() and v_cache.is_contiguous(), "caches must be contiguous")
        out = torch.empty_like(q)
        status = self._functions[q.dtype, k_cache.dtype](
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            page_table.data_ptr(),
            context_lens.data_ptr(),
            out.data_ptr(),
            0,
            *_rows_and_layout(rows, heads, k_cache, page_table, scale),
        )
        _check_status(status)
        return out

    def step(
        self,
        qkv: torch.Tensor,
        heads: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
        page_table: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """A decode-only step of one layer from the fused qkv projection: q and k rotated in
        place, k and v written at ``slots``, then attention. qkv: [rows, (heads + 2 * kv_heads)
        * head_dim] with unit stride along each row; cos, sin: [rows, head_dim / 2] fp32
        contiguous; slots, context_lens: [rows] int64; page_table: [rows, max_pages] int64.
        Returns [rows, heads * head_dim]. The launcher is on every layer's path: it checks what
        the C side relies on and nothing it has checked for an earlier layer of the step."""
        rows = qkv.shape[0]
        kv_heads, _, _, head_dim = k_cache.shape
        step = self._steps.get((qkv.dtype, k_cache.dtype))
        _check(qkv.stride(1) == 1 and step is not None, "bad qkv")
        _check(qkv.shape[1] == (heads + 2 * kv_heads) * head_dim, "qkv and cache disagree")
        _check(cos.shape == (rows, head_dim // 2) and cos.dtype == torch.float32, "bad cos")
        out = qkv.new_empty((rows, heads * head_dim))
        status = step(
            qkv.data_ptr(),
            qkv.stride(0),
            cos.data_ptr(),
            sin.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            slots.data_ptr(),
            page_table.data_ptr(),
            context_lens.data_ptr(),
            out.data_ptr(),
            *_rows_and_layout(rows, heads, k_cache, page_table, scale),
        )
        _check_status(status)
        return out


def _rows_and_layout(
    rows: int, heads: int, k_cache: torch.Tensor, page_table: torch.Tensor, scale: float
) -> tuple:
    """The arguments both entries end with: rows, kv_heads, group, head_dim, num_pages,
    page_size, max_pages, scale."""
    kv_heads, num_pages, page_size, head_dim = k_cache.shape
    group = heads // kv_heads
    return rows, kv_heads, group, head_dim, num_pages, page_size, page_table.shape[1], scale


def _check_status(status: int) -> None:
    _check(status != -2, "the CPU kernel could not get scratch memory")
    _check(status == 0, "the CPU kernel rejected the shapes")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
