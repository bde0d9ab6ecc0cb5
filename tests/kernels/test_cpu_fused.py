"""The fused elementwise CPU kernels against their torch references (yaied/kernels/cpu_fused.py)."""

from __future__ import annotations

import pytest
import torch

from tests.cpu_levels import kernel_at
from tests.kernels.fused_cases import (
    add_rms_norm_case,
    launcher_refusals,
    qk_norm_rotary_case,
    rotary_case,
    silu_mul_case,
)
from yaied.kernels.cpu_fused import CpuFusedOps


@pytest.fixture
def ops(isa_level):
    return kernel_at(CpuFusedOps, isa_level)


DTYPES = pytest.mark.parametrize(
    "dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"]
)
# 3 rows take the serial path; 300 rows x 576 take the threaded one.
ROWS = pytest.mark.parametrize("rows", [3, 300])


@DTYPES
@ROWS
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm(ops, dtype, tolerance, rows, with_delta):
    add_rms_norm_case(ops, dtype, tolerance, rows, with_delta)


@DTYPES
@ROWS
def test_rotary_in_place_on_the_qkv_output(ops, dtype, tolerance, rows):
    rotary_case(ops, dtype, tolerance, rows)


@DTYPES
@ROWS
def test_qk_norm_then_rotary_in_place_on_the_qkv_output(ops, dtype, tolerance, rows):
    qk_norm_rotary_case(ops, dtype, tolerance, rows)


@DTYPES
@ROWS
def test_silu_mul(ops, dtype, tolerance, rows):
    silu_mul_case(ops, dtype, tolerance, rows)


def test_launchers_check_inputs(ops):
    launcher_refusals(ops)
