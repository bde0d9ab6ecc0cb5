"""What the Triton kernels share: launcher checks and the dot-product precision rule.

Triton decides between compiling a kernel and interpreting it (``TRITON_INTERPRET=1``) when
``@triton.jit`` runs, that is when a kernel module is imported: set the variable before importing
``yaied.kernels.triton_*`` to run them on CPU tensors (tests/conftest.py does so where CUDA is
absent). The engine imports these modules only on its CUDA path.
"""

from __future__ import annotations

import os

import torch
import triton

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def interpreting() -> bool:
    """Kernels run in Triton's interpreter: smaller blocks, and dot operands upcast to fp32
    (Triton 3.9's interpreter multiplies bf16 operands' raw bit patterns in tl.dot)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 runs are parity runs: exact fp32 products ("ieee"), not tf32's 10-bit mantissa.
    return "ieee" if dtype == torch.float32 else "tf32"


def next_power_of_2(n: int) -> int:
    return triton.next_power_of_2(max(n, 1))


def check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Pools are [kv_heads, num_pages, page_size, head_dim], rows of head_dim contiguous, and the
    (page, offset) pair addressable as one slot index (page stride = page_size * slot stride)."""
    check(k_cache.dim() == 4, f"caches must be 4-D, got {tuple(k_cache.shape)}")
    check(k_cache.shape == v_cache.shape, "k and v caches differ in shape")
    check(k_cache.stride() == v_cache.stride(), "k and v caches differ in strides")
    check(k_cache.dtype == v_cache.dtype, "k and v caches differ in dtype")
    check(k_cache.dtype in DTYPES, f"unsupported cache dtype {k_cache.dtype}")
    check(k_cache.device == v_cache.device, "k and v caches are on different devices")
    stride = k_cache.stride()
    check(stride[3] == 1, "cache rows (head_dim) must be contiguous")
    check(stride[1] == k_cache.shape[2] * stride[2], "cache pages must be laid out slot by slot")


def check_index(name: str, tensor: torch.Tensor, dims: int, device: torch.device) -> None:
    check(tensor.dim() == dims, f"{name} must be {dims}-D, got {tuple(tensor.shape)}")
    check(tensor.dtype in (torch.int32, torch.int64), f"{name} must be int32 or int64")
    check(tensor.device == device, f"{name} is on {tensor.device}, expected {device}")
    check(tensor.stride(-1) == 1, f"{name} must be contiguous in its last dimension")
