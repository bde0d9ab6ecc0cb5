"""The cases every implementation of the fused elementwise kernels passes (CpuFusedOps on each
ISA level, TritonFusedOps in the interpreter and on a GPU), against the torch references."""

from __future__ import annotations

import pytest
import torch

from yaied.kernels.cpu_fused import rms_norm_reference, rotary_reference, silu_mul_reference


def close(ours, theirs, tolerance):
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=tolerance, atol=tolerance)


def add_rms_norm_case(ops, dtype, tolerance, rows, with_delta, device="cpu", exact_sum=True):
    """exact_sum: the residual sum is torch's to the bit (it rounds where torch does)."""
    torch.manual_seed(0)
    hidden = 576  # not a power of two: blocks and vectors have tails
    residual = (torch.randn(rows, hidden, device=device) * 3).to(dtype)
    delta = torch.randn(rows, hidden, device=device).to(dtype) if with_delta else None
    weight = (torch.rand(hidden, device=device) + 0.5).to(dtype)
    expected_sum = residual + delta if with_delta else residual.clone()
    expected = rms_norm_reference(expected_sum, weight, 1e-5)
    out = ops.add_rms_norm(delta, residual, weight, 1e-5)
    if exact_sum:
        assert torch.equal(residual, expected_sum)
    else:
        close(residual, expected_sum, tolerance)
    close(out, expected, tolerance)


def rotary_case(ops, dtype, tolerance, rows, device="cpu"):
    """Rotary in place on the q and k heads of a fused qkv output; v untouched."""
    torch.manual_seed(1)
    heads, kv_heads, head_dim = 9, 3, 64
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, device=device).to(dtype)
    positions = torch.randint(0, 4000, (rows,), device=device)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    both = torch.cat((freqs, freqs), dim=-1)[:, None]
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(rows, heads + kv_heads, head_dim)
    expected = rotary_reference(qk.float(), both.cos(), both.sin())
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    ops.rotary(qkv, heads + kv_heads, freqs.cos(), freqs.sin())
    close(qk, expected, tolerance)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)


def qk_norm_rotary_case(ops, dtype, tolerance, rows, device="cpu"):
    """Qwen3's q/k norm then rotary, in place on a fused qkv output (12 heads: a masked block
    in Triton; head_dim 128 as Qwen3's); v untouched."""
    torch.manual_seed(3)
    heads, kv_heads, head_dim = 9, 3, 128
    qkv = (torch.randn(rows, (heads + 2 * kv_heads) * head_dim, device=device) * 3).to(dtype)
    q_weight = (torch.rand(head_dim, device=device) + 0.5).to(dtype)
    k_weight = (torch.rand(head_dim, device=device) + 0.5).to(dtype)
    positions = torch.randint(0, 4000, (rows,), device=device)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    both = torch.cat((freqs, freqs), dim=-1)[:, None]
    view = qkv.view(rows, -1, head_dim)
    q = rms_norm_reference(view[:, :heads], q_weight, 1e-6)
    k = rms_norm_reference(view[:, heads : heads + kv_heads], k_weight, 1e-6)
    expected = rotary_reference(torch.cat((q, k), dim=1).float(), both.cos(), both.sin())
    v_before = view[:, heads + kv_heads :].clone()
    ops.qk_norm_rotary(qkv, heads, kv_heads, q_weight, k_weight, 1e-6, freqs.cos(), freqs.sin())
    close(view[:, : heads + kv_heads], expected, tolerance)
    assert torch.equal(view[:, heads + kv_heads :], v_before)


def silu_mul_case(ops, dtype, tolerance, rows, device="cpu"):
    torch.manual_seed(2)
    gate_up = (torch.randn(rows, 2 * 1536, device=device) * 4).to(dtype)
    close(ops.silu_mul(gate_up), silu_mul_reference(gate_up), tolerance)


def launcher_refusals(ops):
    with pytest.raises(ValueError, match="weight"):
        ops.add_rms_norm(None, torch.zeros(2, 8), torch.ones(4), 1e-5)
    with pytest.raises(ValueError, match="fp32"):
        ops.rotary(torch.zeros(2, 16), 1, torch.zeros(2, 4).bfloat16(), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="contiguous"):
        ops.silu_mul(torch.zeros(8, 2).t())
    cos = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="q/k norm weight"):
        ops.qk_norm_rotary(torch.zeros(2, 24), 1, 1, torch.ones(4), torch.ones(8), 1e-6, cos, cos)
