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
import triton.language as tl

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


@triton.jit
def attend_page_block(
    q, acc, m_i, l_i,
    k_cache_ptr, v_cache_ptr, table_row_ptr, head_base, block, end, query_pos, dims, dim_mask,
    stride_cp, stride_cs, qk_scale,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """One online-softmax step of flash attention over context positions [block, block+BLOCK_N),
    read from the pages in ``table_row_ptr``: q [R, D] against the block's K/V, positions at or
    past ``end`` masked, and with CAUSAL also those after each row's ``query_pos`` [R]. Scores
    are in base 2 (``qk_scale`` holds log2 e). Returns the updated (acc [R, D], m_i, l_i [R])."""
    pos = block + tl.arange(0, BLOCK_N)
    pos_mask = pos < end
    page = tl.load(table_row_ptr + pos // PAGE_SIZE, mask=pos_mask, other=0)
    kv_offsets = head_base + page.to(tl.int64) * stride_cp + (pos % PAGE_SIZE) * stride_cs
    kv_mask = pos_mask[:, None] & dim_mask[None, :]
    k = tl.load(k_cache_ptr + kv_offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [R, N]
    if CAUSAL:
        visible = pos_mask[None, :] & (pos[None, :] <= query_pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))
    else:  # query_pos is unused
        scores = tl.where(pos_mask[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_cache_ptr + kv_offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    if UPCAST:
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i
