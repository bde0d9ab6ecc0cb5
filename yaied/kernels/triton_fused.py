"""Fused elementwise kernels for the GPU path: RMSNorm with the residual add, rotary embedding
(optionally after Qwen3's per-head q/k RMSNorm), SiLU-and-multiply. The same operations, with the
same contract, as the CPU's ``CpuFusedOps`` (cpu_fused.py, whose torch references these kernels
are checked against).

Without them a layer on the GPU runs about a dozen small torch kernels between its matmuls
(the fp32 cast, the norm, the cast back, the weight multiply, the residual add, the rotary's
concatenations and products, SiLU, the multiply), each a full read and write of its rows and a
launch of its own; on a batch of decodes they took about 45% of the device time
(docs/benchmarks.md, GPU). Each kernel here makes one pass: one program per row for the norm
and the rotary, blocks of a row for SiLU-and-multiply. Arithmetic is fp32; results are rounded
to the model dtype where torch rounds them (the residual sum, the normalised row before its
weight), so fp32 runs agree with the references to rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from yaied.kernels.cpu_fused import (
    check_add_rms_norm,
    check_qk_norm_rotary,
    check_rotary,
    check_silu_mul,
)
from yaied.kernels.triton_common import next_power_of_2

SILU_BLOCK = 1024  # columns of one SiLU-and-multiply program


@triton.jit
def _add_rms_norm_kernel(
    delta_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    hidden,
    eps,
    HAS_DELTA: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(residual_ptr + row * hidden + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        delta = tl.load(delta_ptr + row * hidden + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + delta.to(tl.float32)).to(x.dtype)  # the residual stream's dtype
        tl.store(residual_ptr + row * hidden + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)  # rounded before the weight, as torch does
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * hidden + cols, (normed * weight).to(x.dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    x_ptr,
    q_weight_ptr,
    k_weight_ptr,
    cos_ptr,
    sin_ptr,
    stride_row,
    q_heads,
    heads,
    eps,
    NORM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    # The rotary of a row's first `heads` heads, in place (rotate-half: [x1 | x2] per head).
    # NORM (Qwen3): each head RMS-normalised first, heads [0, q_heads) with q_weight (q), the
    # rest with k_weight (k), rounding where torch rounds: the normalised head, then its
    # product with the weight.
    row = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < heads) & (d < HALF)
    first = x_ptr + row * stride_row + h * (2 * HALF) + d
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF, mask=mask, other=0.0)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    if NORM:
        square_sum = tl.sum(x1f * x1f, axis=1) + tl.sum(x2f * x2f, axis=1)
        rstd = tl.rsqrt(square_sum / (2 * HALF) + eps)[:, None]
        is_q = h < q_heads
        w1 = tl.where(
            is_q,
            tl.load(q_weight_ptr + d, mask=d < HALF, other=0.0),
            tl.load(k_weight_ptr + d, mask=d < HALF, other=0.0),
        ).to(tl.float32)
        w2 = tl.where(
            is_q,
            tl.load(q_weight_ptr + HALF + d, mask=d < HALF, other=0.0),
            tl.load(k_weight_ptr + HALF + d, mask=d < HALF, other=0.0),
        ).to(tl.float32)
        x1f = ((x1f * rstd).to(x1.dtype).to(tl.float32) * w1).to(x1.dtype).to(tl.float32)
        x2f = ((x2f * rstd).to(x1.dtype).to(tl.float32) * w2).to(x1.dtype).to(tl.float32)
    cos = tl.load(cos_ptr + row * HALF + d, mask=d < HALF, other=0.0)
    sin = tl.load(sin_ptr + row * HALF + d, mask=d < HALF, other=0.0)
    tl.store(first, (x1f * cos - x2f * sin).to(x1.dtype), mask=mask)
    tl.store(first + HALF, (x2f * cos + x1f * sin).to(x1.dtype), mask=mask)


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(gate_up_ptr + row * 2 * width + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * 2 * width + width + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    out = g / (1.0 + tl.exp(-g)) * up.to(tl.float32)
    tl.store(out_ptr + row * width + cols, out.to(gate.dtype), mask=mask)


class TritonFusedOps:
    """``CpuFusedOps``' kernels for tensors on a CUDA device (or CPU tensors under
    TRITON_INTERPRET=1, for tests). Launchers check only what the kernels rely on: they run
    several times per layer, inside CUDA graphs too, so nothing here reads device memory."""

    device_type = "cuda"
    level = "triton"

    @staticmethod
    def supports(dtype: torch.dtype) -> bool:
        return dtype in (torch.float32, torch.bfloat16, torch.float16)

    def add_rms_norm(
        self,
        delta: torch.Tensor | None,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
    ) -> torch.Tensor:
        """CpuFusedOps.add_rms_norm: residual += delta in place, then weight * its norm."""
        rows, hidden = residual.shape
        delta = check_add_rms_norm(delta, residual, weight)
        out = torch.empty_like(residual)
        if rows:
            block = next_power_of_2(hidden)
            _add_rms_norm_kernel[(rows,)](
                residual if delta is None else delta,  # an unused pointer without a delta
                residual,
                weight,
                out,
                hidden,
                eps,
                HAS_DELTA=delta is not None,
                BLOCK=block,
                num_warps=min(max(block // 256, 1), 16),
            )
        return out

    def rotary(self, x: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """CpuFusedOps.rotary: the first ``heads`` heads of each row of x rotated in place."""
        check_rotary(x, heads, cos, sin)
        self._rotate(x, heads, 0, x, x, 0.0, cos, sin, norm=False)  # no weights: x stands in

    def qk_norm_rotary(
        self,
        x: torch.Tensor,
        q_heads: int,
        k_heads: int,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        eps: float,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> None:
        """CpuFusedOps.qk_norm_rotary, in one kernel where torch runs ten."""
        check_qk_norm_rotary(x, q_heads + k_heads, q_weight, k_weight, cos, sin)
        self._rotate(x, q_heads + k_heads, q_heads, q_weight, k_weight, eps, cos, sin, norm=True)

    @staticmethod
    def _rotate(x, heads, q_heads, q_weight, k_weight, eps, cos, sin, *, norm: bool) -> None:
        rows, half = cos.shape
        if rows:
            _rotary_kernel[(rows,)](
                x, q_weight, k_weight, cos, sin, x.stride(0), q_heads, heads, eps,
                NORM=norm, HALF=half, BLOCK_H=next_power_of_2(heads),
                BLOCK_HALF=next_power_of_2(half),
            )  # fmt: skip

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: [rows, 2 * width] contiguous -> silu(gate) * up, [rows, width]."""
        rows, double = gate_up.shape
        check_silu_mul(gate_up)
        width = double // 2
        out = gate_up.new_empty(rows, width)
        if rows:
            block = min(SILU_BLOCK, next_power_of_2(width))
            _silu_mul_kernel[(rows, triton.cdiv(width, block))](
                gate_up, out, width, BLOCK=block, num_warps=4
            )
        return out
