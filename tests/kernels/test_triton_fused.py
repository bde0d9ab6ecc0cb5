"""The fused elementwise Triton kernels (yaied/kernels/triton_fused.py) against the same torch
references as the CPU's (cpu_fused.py): in Triton's interpreter on CPU tensors, and compiled
on a CUDA device at a batch's size."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_cases import interpreter_only
from yaied.kernels.cpu_fused import rms_norm_reference, rotary_reference, silu_mul_reference
from yaied.kernels.triton_fused import TritonFusedOps

DTYPES = pytest.mark.parametrize(
    "dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"]
)
# (device, rows): a few rows in the interpreter; a batch of 256 decodes and a 2,000-token
# prefill compiled on a GPU.
PLACES = pytest.mark.parametrize(
    "device, rows",
    [
        pytest.param("cpu", 3, marks=interpreter_only),
        pytest.param("cuda", 256, marks=pytest.mark.cuda),
        pytest.param("cuda", 2000, marks=pytest.mark.cuda),
    ],
)


def close(ours, theirs, tolerance):
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=tolerance, atol=tolerance)


@DTYPES
@PLACES
@pytest.mark.parametrize("with_delta", [True, False], ids=["delta", "no-delta"])
def test_add_rms_norm(dtype, tolerance, device, rows, with_delta):
    torch.manual_seed(0)
    hidden = 576  # not a power of two: the row's block is masked
    residual = (torch.randn(rows, hidden, device=device) * 3).to(dtype)
    delta = torch.randn(rows, hidden, device=device).to(dtype) if with_delta else None
    weight = (torch.rand(hidden, device=device) + 0.5).to(dtype)
    expected_sum = residual + delta if with_delta else residual.clone()
    expected = rms_norm_reference(expected_sum, weight, 1e-5)
    out = TritonFusedOps().add_rms_norm(delta, residual, weight, 1e-5)
    if device == "cuda" or dtype == torch.float32:
        assert torch.equal(residual, expected_sum)  # the residual add rounds as torch's does
    else:  # Triton 3.9's interpreter truncates fp32 to bf16 instead of rounding to nearest
        close(residual, expected_sum, tolerance)
    close(out, expected, tolerance)


@DTYPES
@PLACES
def test_rotary_in_place_on_the_qkv_output(dtype, tolerance, device, rows):
    torch.manual_seed(1)
    heads, kv_heads, head_dim = 9, 3, 64  # 12 rotated heads: the head block is masked too
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, device=device).to(dtype)
    positions = torch.randint(0, 4000, (rows,), device=device)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    both = torch.cat((freqs, freqs), dim=-1)[:, None]
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(rows, heads + kv_heads, head_dim)
    expected = rotary_reference(qk.float(), both.cos(), both.sin())
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    TritonFusedOps().rotary(qkv, heads + kv_heads, freqs.cos(), freqs.sin())
    close(qk, expected, tolerance)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)  # v untouched


@DTYPES
@PLACES
def test_silu_mul(dtype, tolerance, device, rows):
    torch.manual_seed(2)
    # 1,536 columns: one full block and one masked one
    gate_up = (torch.randn(rows, 2 * 1536, device=device) * 4).to(dtype)
    close(TritonFusedOps().silu_mul(gate_up), silu_mul_reference(gate_up), tolerance)


def test_launchers_check_inputs():
    ops = TritonFusedOps()
    with pytest.raises(ValueError, match="weight"):
        ops.add_rms_norm(None, torch.zeros(2, 8), torch.ones(4), 1e-5)
    with pytest.raises(ValueError, match="fp32"):
        ops.rotary(torch.zeros(2, 16), 1, torch.zeros(2, 4).bfloat16(), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="contiguous"):
        ops.silu_mul(torch.zeros(8, 2).t())


def test_a_model_on_cpu_keeps_its_cpu_kernels():
    """The Triton kernels are for weights on a GPU: a CPU model refuses them."""
    from yaied.worker.models.llama import LlamaForCausalLM, LlamaShape

    shape = LlamaShape(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        qkv_bias=False,
        qk_norm=False,
        mlp_bias=False,
    )
    model = LlamaForCausalLM(shape, torch.ones(4), 1.0)
    assert not model.use_fused_ops(TritonFusedOps())
    assert model.fused_ops is None
