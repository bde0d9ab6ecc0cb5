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


@pytest.mark.parametrize("n", [1, 7, 16, 49152, 49157], ids=lambda n: f"n{n}")
@pytest.mark.parametrize("rows", [1, 5, 32])
def test_argmax_is_torchs(ops, rows, n):
    """Greedy sampling's argmax: torch's indices, ties to the first, at every level (vector
    bodies and their scalar tails; 32 rows of 49152 take the threads)."""
    generator = torch.Generator().manual_seed(rows * 100003 + n)
    logits = torch.randn(rows, n, generator=generator)
    if n > 1:  # ties: the maximum again further on, and early (lane 3) in another row
        top = logits.max(dim=-1).values
        logits[0, n - 1] = top[0]
        logits[rows - 1, min(3, n - 1)] = top[rows - 1]
        logits[rows - 1, n - 1] = top[rows - 1]
    assert torch.equal(ops.argmax(logits), logits.argmax(dim=-1))


def test_argmax_rows_torch_would_mark(ops):
    """Rows the engine fails as non-finite still get torch's answer: the first NaN, the first
    +inf, and 0 for a row of -inf (a grammar's fully masked row)."""
    logits = torch.randn(4, 1000)
    logits[0, 17] = float("nan")
    logits[0, 900] = float("nan")
    logits[1, 40] = float("inf")
    logits[1, 41] = float("inf")
    logits[2] = float("-inf")
    logits[3, 999] = float("nan")  # in the scalar tail of every level
    assert torch.equal(ops.argmax(logits), logits.argmax(dim=-1))
    assert torch.equal(ops.argmax(logits[:, :500].clone()), logits[:, :500].argmax(dim=-1))
    # what the kernel does not take goes to torch
    half = logits.bfloat16()
    assert torch.equal(ops.argmax(half), half.argmax(dim=-1))
    assert torch.equal(ops.argmax(logits[:, ::2]), logits[:, ::2].argmax(dim=-1))


@pytest.mark.parametrize("vocab", [31, 64, 49152, 49157], ids=lambda v: f"v{v}")
def test_token_bitmask_is_xgrammars(ops, vocab):
    """Structured outputs' masks: the same -inf entries as xgrammar's kernel, for words of all
    zeros, all ones and mixed bits, a ragged last word, listed rows only, columns past the
    vocabulary left alone (apply_bitmask bans those itself)."""
    xgr = pytest.importorskip("xgrammar")
    generator = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    mask = torch.randint(-(2**31), 2**31 - 1, (6, words), dtype=torch.int32, generator=generator)
    mask[1] = 0
    mask[2] = -1
    mask[3, : words // 2] = 0
    logits = torch.randn(6, vocab + 5, generator=generator)
    rows = [0, 1, 3, 5]
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, mask, vocab_size=vocab, indices=rows)
    assert ops.apply_token_bitmask(logits, mask, rows, vocab)
    assert torch.equal(logits, expected)
    # what it does not take, it leaves to the caller
    assert not ops.apply_token_bitmask(logits.double(), mask, rows, vocab)
    assert not ops.apply_token_bitmask(logits, mask, [6], vocab)
    assert not ops.apply_token_bitmask(logits, mask, rows, words * 32 + 1)
