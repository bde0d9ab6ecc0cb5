"""The fused elementwise CPU kernels against their torch references (yaied/kernels/cpu_fused.py)."""

from __future__ import annotations

import pytest
import torch

from tests.cpu_levels import kernel_at
from yaied.kernels.cpu_fused import (
    CpuFusedOps,
    rms_norm_reference,
    rotary_reference,
    silu_mul_reference,
)


@pytest.fixture
def ops(isa_level):
    return kernel_at(CpuFusedOps, isa_level)


DTYPES = pytest.mark.parametrize(
    "dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"]
)
# 3 rows take the serial path; 300 rows x 576 take the threaded one.
ROWS = pytest.mark.parametrize("rows", [3, 300])


def close(ours, theirs, tolerance):
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=tolerance, atol=tolerance)


@DTYPES
@ROWS
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm(ops, dtype, tolerance, rows, with_delta):
    torch.manual_seed(0)
    hidden = 576
    residual = (torch.randn(rows, hidden) * 3).to(dtype)
    delta = torch.randn(rows, hidden).to(dtype) if with_delta else None
    weight = (torch.rand(hidden) + 0.5).to(dtype)
    expected_sum = residual + delta if with_delta else residual.clone()
    expected = rms_norm_reference(expected_sum, weight, 1e-5)
    out = ops.add_rms_norm(delta, residual, weight, 1e-5)
    assert torch.equal(residual, expected_sum)  # the residual add rounds as torch's does
    close(out, expected, tolerance)


@DTYPES
@ROWS
def test_rotary_in_place_on_the_qkv_output(ops, dtype, tolerance, rows):
    torch.manual_seed(1)
    heads, kv_heads, head_dim = 9, 3, 64
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim).to(dtype)
    positions = torch.randint(0, 4000, (rows,))
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    both = torch.cat((freqs, freqs), dim=-1)[:, None]
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(rows, heads + kv_heads, head_dim)
    expected = rotary_reference(qk.float(), both.cos(), both.sin())
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    ops.rotary(qkv, heads + kv_heads, cos, sin)
    close(qk, expected, tolerance)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)  # v untouched


@DTYPES
@ROWS
def test_silu_mul(ops, dtype, tolerance, rows):
    torch.manual_seed(2)
    gate_up = (torch.randn(rows, 2 * 1536) * 4).to(dtype)
    close(ops.silu_mul(gate_up), silu_mul_reference(gate_up), tolerance)


def test_launchers_check_inputs(ops):
    with pytest.raises(ValueError, match="weight"):
        ops.add_rms_norm(None, torch.zeros(2, 8), torch.ones(4), 1e-5)
    with pytest.raises(ValueError, match="fp32"):
        ops.rotary(torch.zeros(2, 16), 1, torch.zeros(2, 4).bfloat16(), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="contiguous"):
        ops.silu_mul(torch.zeros(8, 2).t())
