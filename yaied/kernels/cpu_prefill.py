"""Launcher for the CPU paged prefill-attention kernel (cpu_paged_prefill.c).

The torch path (yaied.worker.attention._prefill_attention) runs SDPA over the chunk's own K/V, or
gathers the cached context and runs SDPA with an explicit mask; torch's CPU flash kernel reaches
about a sixth of the bf16 matmul rate at a 512-token chunk. The C kernel reads K/V straight from
the pages, blocks keys and queries so the grouped query heads of a kv head share every key block,
and multiplies bf16 on AMX tiles or with AVX512-BF16 dot products where the CPU has them.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from yaied.kernels.cpu_build import KernelLibrary, load_library

SOURCE = Path(__file__).with_name("cpu_paged_prefill.c")
_ARGTYPES = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 10 + [ctypes.c_float] + [ctypes.c_int64] * 2
MAX_GROUP, MAX_HEAD_DIM = 16, 256


class CpuPrefillKernel:
    """The compiled kernel; ``CpuPrefillKernel.load()`` returns None where it cannot be built."""

    def __init__(self, library: KernelLibrary) -> None:
        self.level = library.level
        self._function = library.cdll.paged_prefill
        self._function.argtypes = _ARGTYPES
        self._function.restype = ctypes.c_int
        self._chunks = library.cdll.paged_prefill_chunks
        self._chunks.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 9
        self._chunks.argtypes += [ctypes.c_float] + [ctypes.c_int64] * 2
        self._chunks.restype = ctypes.c_int
        self.has_bf16_dot = bool(library.cdll.paged_prefill_has_bf16_dot())
        one_thread = library.cdll.paged_prefill_one_thread_flops
        one_thread.restype = ctypes.c_double
        self._one_thread_flops = one_thread()
        # AMX tiles: where the build targets them and Linux grants the process the tile state.
        self.has_amx = bool(library.cdll.paged_prefill_amx_ready())
        # Tests clear these to run bf16 through the slower paths on a CPU with the fast ones.
        self.use_bf16_dot = True
        self.use_amx = True

    @classmethod
    def load(
        cls, level: str | None = None, cache_dir: Path | None = None, *, strict: bool = False
    ) -> CpuPrefillKernel | None:
        library = load_library(SOURCE, level, cache_dir, strict=strict)
        return None if library is None else cls(library)

    @staticmethod
    def supports(
        dtype: torch.dtype, group: int, head_dim: int, kv_dtype: torch.dtype | None = None
    ) -> bool:
        """``dtype``: the activations'; ``kv_dtype``: the pools' (default the same): bf16 pools
        under fp32 activations too (``cache.kv_cache_dtype``)."""
        return (
            dtype in (torch.bfloat16, torch.float32)
            and kv_dtype in (None, dtype, torch.bfloat16)
            and group <= MAX_GROUP
            and head_dim <= MAX_HEAD_DIM
            and head_dim % 16 == 0
        )

    def runs_alone(self, num_tokens: int, start_pos: int, heads: int, head_dim: int) -> bool:
        """Whether ``__call__`` runs such a chunk on the calling thread alone (too little work
        for a fork-join): many of them go faster through ``chunks``, a thread a chunk."""
        flops = 4.0 * head_dim * heads * num_tokens * (start_pos + num_tokens / 2.0)
        return flops < self._one_thread_flops

    def path(self, dtype: torch.dtype, head_dim: int) -> str:
        """Which body runs a chunk of this dtype and head size: ``amx`` (tiles), ``bf16-dot``
        (AVX512-BF16 dot products; bf16 and head_dim a multiple of 64, as the AMX path) or
        ``fp32`` (everything converted, and the only path without AVX512-BF16)."""
        dot = self.use_bf16_dot and self.has_bf16_dot
        if dtype != torch.bfloat16 or head_dim % 64 or not dot:
            return "fp32"
        return "amx" if self.has_amx and self.use_amx else "bf16-dot"

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        pages: torch.Tensor,
        start_pos: int,
        scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal attention of a chunk at positions [start_pos, start_pos + n) over its whole
        context, whose K/V (the chunk's own included) are already in the pages.
        q: [n, heads, head_dim]; caches: [kv_heads, num_pages, page_size, head_dim];
        pages: [>= ceil((start_pos + n) / page_size)] int64. Returns (or fills ``out``) like q."""
        n, heads, head_dim = q.shape
        kv_heads, num_pages, page_size, cache_dim = k_cache.shape
        _check(q.device.type == "cpu", "the CPU kernel needs CPU tensors")
        _check(cache_dim == head_dim and heads % kv_heads == 0, "q and cache shapes disagree")
        group, kv_dtype = heads // kv_heads, k_cache.dtype
        _check(self.supports(q.dtype, group, head_dim, kv_dtype), "unsupported shapes or dtype")
        _check(v_cache.shape == k_cache.shape, "k and v caches differ in shape")
        _check(v_cache.dtype == kv_dtype, "k and v caches differ in dtype")
        _check(pages.dtype == torch.int64 and pages.dim() == 1, "pages must be 1-d int64")
        _check(n >= 1 and start_pos >= 0, "empty chunk or negative start")
        _check(pages.numel() * page_size >= start_pos + n, "too few pages for the context")
        _check(k_cache.is_contiguous() and v_cache.is_contiguous(), "caches must be contiguous")
        q, pages = q.contiguous(), pages.contiguous()
        if out is None:
            out = torch.empty_like(q)
        _check(out.shape == q.shape and out.dtype == q.dtype, "out differs from q")
        _check(out.is_contiguous(), "out must be contiguous")
        status = self._function(
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            pages.data_ptr(),
            out.data_ptr(),
            int(q.dtype == torch.bfloat16),
            int(kv_dtype == torch.bfloat16),
            int(self.use_bf16_dot),
            n,
            start_pos,
            kv_heads,
            heads // kv_heads,
            head_dim,
            num_pages,
            page_size,
            scale,
            torch.get_num_threads(),
            int(self.use_amx),
        )
        _check(status == 0, "the CPU kernel rejected the shapes")
        return out

    def chunks(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        pages: torch.Tensor,
        chunks: torch.Tensor,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """Many chunks in one call, each the bits ``__call__`` gives it (one thread a chunk:
        for many small ones, as engine.batch_invariant's one-token decodes). q, out: [rows,
        heads, head_dim], out contiguous; chunks: [num_chunks, 4] int64 rows of (first row,
        rows, first position, start of its page table in ``pages``), within q's rows."""
        heads, head_dim = q.shape[1:]
        kv_heads, num_pages, page_size, cache_dim = k_cache.shape
        _check(cache_dim == head_dim and heads % kv_heads == 0, "q and cache shapes disagree")
        kv_dtype = k_cache.dtype
        _check(
            self.supports(q.dtype, heads // kv_heads, head_dim, kv_dtype),
            "unsupported shapes or dtype",
        )
        _check(q.dtype == out.dtype and v_cache.dtype == kv_dtype, "dtypes differ")
        _check(out.shape == q.shape and out.is_contiguous(), "out must be contiguous, like q")
        _check(chunks.dtype == pages.dtype == torch.int64, "chunks and pages must be int64")
        _check(chunks.dim() == 2 and chunks.shape[1] == 4, "chunks must be [num_chunks, 4]")
        q, chunks, pages = q.contiguous(), chunks.contiguous(), pages.contiguous()
        status = self._chunks(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), pages.data_ptr(),
            chunks.data_ptr(), out.data_ptr(), chunks.shape[0], int(q.dtype == torch.bfloat16),
            int(kv_dtype == torch.bfloat16), int(self.use_bf16_dot), kv_heads, heads // kv_heads,
            head_dim, num_pages, page_size, scale, torch.get_num_threads(), int(self.use_amx),
        )  # fmt: skip
        _check(status == 0, "the CPU kernel rejected the shapes")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
