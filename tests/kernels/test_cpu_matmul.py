"""The panel matmul (cpu_matmul.c) gives F.linear's result over the same fp32 weight at every ISA
level: any row count (across its tiles and row blocks), widths that are not a multiple of a
panel, any K, with and without bias; each row's result is the same bits alone and in any batch,
and the same bits whether its panel goes over k in blocks or in one pass; bad input is refused
before the C side sees it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.cpu_levels import kernel_at
from yaied.kernels.cpu_matmul import CpuMatmul, pack_panels


@pytest.fixture
def matmul(isa_level):
    return kernel_at(CpuMatmul, isa_level)


def _reference(x, weight, bias):
    out = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    return out.float()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    "rows, n, k",
    [(1, 16, 8), (5, 37, 33), (13, 160, 96), (32, 576, 64), (64, 7, 130), (515, 40, 24)],
)
def test_panels_match_linear(matmul, rows, n, k, bias):
    torch.manual_seed(rows * n + k)
    weight = torch.randn(n, k).bfloat16()  # widened exactly, as under fp32 math
    b = torch.randn(n) if bias else None
    x = torch.randn(rows, k)
    got = matmul(x, weight, b)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, _reference(x, weight.float(), b), rtol=1e-4, atol=1e-4)


def test_a_row_is_the_same_bits_alone_and_in_any_batch(matmul):
    torch.manual_seed(0)
    bound = matmul.bind(torch.randn(50, 72), torch.randn(50))
    x = torch.randn(40, 72)
    batch = bound(x)
    for rows in (1, 2, 5, 7, 13, 40):  # different tiles: 6, 5+4, 7 x 6 ...
        assert torch.equal(bound(x[:rows]), batch[:rows])
    assert all(torch.equal(bound(x[r : r + 1])[0], batch[r]) for r in (0, 17, 39))


# Past the kernel's block of k (128 KiB of a panel: 1024 lines at AVX-512, 2048 below)
WIDE_K = 3 * 2048 + 5


def test_a_wide_k_is_summed_in_blocks_to_the_same_bits(matmul):
    """A whole panel goes over a wide K in blocks; a partial one (the columns past the last
    whole panel) in one pass: the same columns give the same bits either way."""
    torch.manual_seed(1)
    width = matmul.width
    weight, bias = torch.randn(width + 3, WIDE_K).bfloat16(), torch.randn(width + 3)
    x = torch.randn(13, WIDE_K)
    once = matmul(x, weight, bias)[:, width:]  # the partial panel: one pass
    # The same three columns first in a whole panel: blocks of k
    in_blocks = matmul(x, torch.cat([weight[width:], weight[3:width]]), bias[-width:].roll(3))
    assert torch.equal(in_blocks[:, :3], once)
    torch.testing.assert_close(once, _reference(x, weight[width:].float(), bias[width:]),
                               rtol=1e-4, atol=1e-3)  # fmt: skip
    bound = matmul.bind(weight, bias)
    assert all(torch.equal(bound(x[r : r + 1])[0], bound(x)[r]) for r in (0, 6, 12))


def test_the_panel_layout(matmul):
    width = matmul.width
    weight = torch.arange(3 * 5, dtype=torch.float32).view(3, 5)
    panels = pack_panels(weight, width)
    assert panels.shape == (1, 5, width)
    assert torch.equal(panels[0, :, :3], weight.T) and not panels[0, :, 3:].any()


def test_bad_input_is_refused(matmul):
    bound = matmul.bind(torch.randn(8, 16))
    with pytest.raises(ValueError, match="bad input"):
        bound(torch.randn(2, 15))
    with pytest.raises(ValueError, match="bad input"):
        bound(torch.randn(2, 16).bfloat16())
    with pytest.raises(ValueError, match="bad bias"):
        matmul.bind(torch.randn(8, 16), torch.randn(7))
    with pytest.raises(ValueError, match="weight"):
        matmul.bind(torch.randn(8))
    assert bound(torch.randn(0, 16)).shape == (0, 8)


@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("with_delta", [False, True])
def test_the_decode_loops_entry_runs_the_norm_and_silu_around_the_matmul(
    matmul, isa_level, silu, with_delta
):
    """panel_rows_linear_f32, the decode loop's entry past the few-row kernel's rows: the
    residual add and RMSNorm before, SiLU-and-multiply after, as the fused kernels do them."""
    from yaied.kernels.cpu_fused import CpuFusedOps

    fused = kernel_at(CpuFusedOps, isa_level)
    torch.manual_seed(3)
    rows, k, n = 21, 64, 96
    bound = matmul.bind(torch.randn(n, k).bfloat16(), torch.randn(n))
    residual, delta = torch.randn(rows, k), torch.randn(rows, k) if with_delta else None
    norm_weight = torch.rand(k) + 0.5
    expected_residual = residual.clone()
    normed = fused.add_rms_norm(delta, expected_residual, norm_weight, 1e-5)
    linear = bound(normed)
    expected = fused.silu_mul(linear) if silu else linear
    got = bound.normed(delta, residual, norm_weight, 1e-5, silu)
    assert torch.equal(residual, expected_residual)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
