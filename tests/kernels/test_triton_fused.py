"""The fused elementwise Triton kernels (yaied/kernels/triton_fused.py) against the same torch
references as the CPU's (cpu_fused.py): in Triton's interpreter on CPU tensors, and compiled
on a CUDA device at a batch's size."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.fused_cases import (
    add_rms_norm_case,
    launcher_refusals,
    qk_norm_rotary_case,
    rotary_case,
    silu_mul_case,
)
from tests.kernels.triton_cases import interpreter_only
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


@DTYPES
@PLACES
@pytest.mark.parametrize("with_delta", [True, False], ids=["delta", "no-delta"])
def test_add_rms_norm(dtype, tolerance, device, rows, with_delta):
    # Triton 3.9's interpreter truncates fp32 to bf16 instead of rounding to nearest, so there
    # the bf16 residual sum is only close to torch's; compiled, it is torch's to the bit.
    exact = device == "cuda" or dtype == torch.float32
    add_rms_norm_case(TritonFusedOps(), dtype, tolerance, rows, with_delta, device, exact)


@DTYPES
@PLACES
def test_rotary_in_place_on_the_qkv_output(dtype, tolerance, device, rows):
    rotary_case(TritonFusedOps(), dtype, tolerance, rows, device)  # 12 heads: a masked block


@DTYPES
@PLACES
def test_qk_norm_then_rotary_in_place_on_the_qkv_output(dtype, tolerance, device, rows):
    qk_norm_rotary_case(TritonFusedOps(), dtype, tolerance, rows, device)


@DTYPES
@PLACES
def test_silu_mul(dtype, tolerance, device, rows):
    silu_mul_case(TritonFusedOps(), dtype, tolerance, rows, device)  # 1,536: a masked block


def test_launchers_check_inputs():
    launcher_refusals(TritonFusedOps())


def test_a_model_on_cpu_keeps_its_cpu_kernels():
    """The Triton kernels are for weights on a GPU: a CPU model refuses them."""
    from transformers import LlamaConfig

    from tests.conftest import TINY_CONFIGS
    from yaied.worker.models.llama import LlamaForCausalLM, LlamaShape

    shape = LlamaShape.from_hf_config(LlamaConfig(**TINY_CONFIGS["llama"]))
    model = LlamaForCausalLM(shape, torch.ones(shape.head_dim // 2), 1.0)
    assert not model.use_fused_ops(TritonFusedOps())
    assert model.fused_ops is None
