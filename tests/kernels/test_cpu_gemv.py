"""The few-row linear kernel over bf16 weights against F.linear, at every ISA level and for both
activation dtypes (bf16, and fp32 over bf16 weights): every row count it takes, shapes whose
sizes are not multiples of its blocks or vectors (the tails), bias, a row's bits alone and in a
batch, and the launcher's refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.cpu_levels import kernel_at
from yaied.kernels.cpu_fused import CpuFusedOps
from yaied.kernels.cpu_gemv import (
    AMX_MAX_ROWS,
    CHUNK,
    GROUP,
    MAX_ROWS,
    CpuGemv,
    pack_weight,
    unpack_weight,
)

DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])


@pytest.fixture
def gemv(isa_level):
    return kernel_at(CpuGemv, isa_level)


@DTYPES
@pytest.mark.parametrize("rows", range(1, MAX_ROWS + 1))
@pytest.mark.parametrize("n, k", [(960, 576), (576, 1536), (7, 33), (5, 64), (13, 100), (1, 1)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_linear(gemv, dtype, rows, n, k, bias):
    torch.manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k).to(dtype)
    weight = (torch.randn(n, k) / k**0.5).to(torch.bfloat16)
    b = torch.randn(n).to(dtype) if bias else None
    expected = F.linear(x.float(), weight.float(), None if b is None else b.float())
    got = gemv(x, weight, b)
    assert got.dtype == dtype and got.shape == (rows, n)
    # fp32 accumulation; for bf16, one rounding of the result (and of the bias sum)
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.float(), expected, rtol=tolerance, atol=tolerance)


@DTYPES
@pytest.mark.parametrize("n, k", [(200, 576), (13, 100)])
def test_a_row_does_not_depend_on_the_other_rows(gemv, dtype, n, k):
    # Bit for bit at every row count (seeded sampling must not change with the batch), also
    # for weight rows past the last full block and elements past the last full vector.
    torch.manual_seed(3)
    x = torch.randn(MAX_ROWS, k).to(dtype)
    weight = (torch.randn(n, k) / 24).to(torch.bfloat16)
    bias = torch.randn(n).to(dtype)
    alone = [gemv(x[r : r + 1], weight, bias)[0] for r in range(MAX_ROWS)]
    for rows in range(2, MAX_ROWS + 1):
        together = gemv(x[:rows], weight, bias)
        assert all(torch.equal(together[r], alone[r]) for r in range(rows))


@DTYPES
def test_in_slices_gives_every_row_its_bits_alone(gemv, dtype):
    # An LM head's rows past MAX_ROWS go MAX_ROWS at a time: each row the same bits as alone.
    torch.manual_seed(4)
    rows = 2 * MAX_ROWS + 3
    x = torch.randn(rows, 100).to(dtype)
    weight = (torch.randn(37, 100) / 10).to(torch.bfloat16)
    bound = gemv.bind(weight, torch.randn(37).to(dtype), dtype)
    together = bound.in_slices(x)
    assert together.shape == (rows, 37) and together.dtype == dtype
    assert all(torch.equal(together[r], bound(x[r : r + 1])[0]) for r in range(rows))
    assert torch.equal(bound.in_slices(x[:3]), bound(x[:3]))
    with pytest.raises(ValueError, match="bad input"):
        bound.in_slices(x[:0])


def test_strided_input_rows(gemv):
    x = torch.randn(2, 80).to(torch.bfloat16)[:, :64]
    weight = torch.randn(8, 64).to(torch.bfloat16)
    torch.testing.assert_close(gemv(x, weight).float(), F.linear(x, weight).float())


@pytest.mark.parametrize("n, k", [(16, 64), (7, 33), (13, 100)])
def test_streaming_layout_interleaves_rows_a_cache_line_at_a_time(n, k):
    weight = torch.randn(n, k).to(torch.bfloat16)
    packed = pack_weight(weight)
    groups, chunks = -(-n // GROUP), -(-k // CHUNK)
    assert packed.shape == (groups, chunks, GROUP, CHUNK) and packed.is_contiguous()
    # a group's rows, 64 bytes each, then their next 64 bytes: row 1's start follows row 0's
    assert torch.equal(packed.flatten()[CHUNK : CHUNK + min(k, CHUNK)], weight[1, :CHUNK])
    padded = torch.zeros(groups * GROUP, chunks * CHUNK, dtype=torch.bfloat16)
    padded[:n, :k] = weight
    assert torch.equal(packed.transpose(1, 2).reshape(padded.shape), padded)  # zeros around
    assert torch.equal(unpack_weight(packed, n, k), weight)


def test_a_strided_weight_is_laid_out_anew(gemv):
    weight = torch.randn(64, 24).to(torch.bfloat16).t()  # [24, 64], not contiguous
    x = torch.randn(3, 64).to(torch.bfloat16)
    torch.testing.assert_close(gemv(x, weight).float(), F.linear(x, weight).float())


def test_launcher_refuses_what_the_kernel_cannot_take(gemv):
    weight = torch.zeros(8, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bad input"):
        gemv(torch.zeros(MAX_ROWS + 1, 64, dtype=torch.bfloat16), weight)
    with pytest.raises(ValueError, match="bad input"):
        gemv(torch.zeros(1, 32, dtype=torch.bfloat16), weight)
    with pytest.raises(ValueError, match="bad input"):
        gemv.bind(weight)(torch.zeros(1, 64))  # fp32 input to a bf16-bound layer
    with pytest.raises(ValueError, match="bf16 weight"):
        gemv.bind(weight.float())
    with pytest.raises(ValueError, match="bias"):
        gemv.bind(weight, torch.zeros(7, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bias"):
        gemv.bind(weight, torch.zeros(8, dtype=torch.bfloat16), torch.float32)


@DTYPES
@pytest.mark.parametrize("rows", range(1, MAX_ROWS + 1))
@pytest.mark.parametrize("with_delta", [False, True])
@pytest.mark.parametrize("silu", [False, True])
def test_normed_is_the_fused_kernels_then_the_linear(gemv, dtype, rows, with_delta, silu):
    """residual += delta, RMSNorm, linear, SiLU-and-multiply in one call: the same bits as
    cpu_fused's kernels (at the same level) around the kernel's plain linear, and the same
    residual update."""
    ops = kernel_at(CpuFusedOps, gemv.level)
    torch.manual_seed(rows)
    k, n = 96, 2 * 40
    weight = (torch.randn(n, k) / k**0.5).to(torch.bfloat16)
    bias = torch.randn(n).to(dtype)
    norm_weight = (1 + torch.randn(k) / 4).to(dtype)
    residual = torch.randn(rows, k).to(dtype)
    delta = torch.randn(rows, k).to(dtype) if with_delta else None
    bound = gemv.bind(weight, bias, dtype)

    expected_residual = residual.clone()
    expected = bound(ops.add_rms_norm(delta, expected_residual, norm_weight, 1e-5))
    if silu:
        expected = ops.silu_mul(expected)
    got = bound.normed(delta, residual, norm_weight, 1e-5, silu)
    assert torch.equal(residual, expected_residual)
    assert torch.equal(got, expected)


@pytest.fixture(scope="module")
def amx_gemv():
    """The kernel at this CPU's own level, where that build has the AMX body and the tiles."""
    gemv = CpuGemv.load()
    if gemv is None or not gemv.amx:
        pytest.skip("no AMX tiles on this CPU (or the kernel was built without them)")
    return gemv


@pytest.mark.parametrize("rows", [MAX_ROWS + 1, 16, 17, 31, AMX_MAX_ROWS])
@pytest.mark.parametrize("n, k", [(960, 576), (576, 1536), (13, 50), (24, 64), (8, 2)])
@pytest.mark.parametrize("bias", [False, True])
def test_amx_matches_linear(amx_gemv, rows, n, k, bias):
    """Row counts that fill one, one and a bit, and two blocks of 16 input rows; weights of
    one group, of an odd number of groups and with a part group; K not a multiple of CHUNK."""
    torch.manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k).to(torch.bfloat16)
    weight = (torch.randn(n, k) / k**0.5).to(torch.bfloat16)
    b = torch.randn(n).to(torch.bfloat16) if bias else None
    layer = amx_gemv.bind(weight, b)
    assert layer.amx_takes(x)
    expected = F.linear(x.float(), weight.float(), None if b is None else b.float())
    got = layer.amx(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    torch.testing.assert_close(got.float(), expected, rtol=1e-2, atol=1e-2)


def test_amx_row_does_not_depend_on_the_other_rows(amx_gemv):
    """Up to 8 rows come through the few-row entry (which runs the AMX body too), fewer than 16
    on tiles as narrow as the rows: a row's bits are the same in every batch."""
    torch.manual_seed(3)
    x = torch.randn(AMX_MAX_ROWS, 576).to(torch.bfloat16)
    layer = amx_gemv.bind((torch.randn(960, 576) / 24).to(torch.bfloat16))
    whole = layer.amx(x)
    for rows in (1, 3, MAX_ROWS, MAX_ROWS + 1, 15, 16, 17, 20, 31):
        for start in (0, AMX_MAX_ROWS - rows):
            part = x[start : start + rows].clone()
            got = layer(part) if rows <= MAX_ROWS else layer.amx(part)
            assert torch.equal(got, whole[start : start + rows])


def test_amx_takes_only_its_rows(amx_gemv):
    layer = amx_gemv.bind(torch.randn(16, 64).to(torch.bfloat16))
    assert not layer.amx_takes(torch.zeros(MAX_ROWS, 64, dtype=torch.bfloat16))
    assert not layer.amx_takes(torch.zeros(AMX_MAX_ROWS + 1, 64, dtype=torch.bfloat16))
    assert not layer.amx_takes(torch.zeros(16, 64))  # fp32 activations
    assert not amx_gemv.bind(torch.randn(16, 64).to(torch.bfloat16), dtype=torch.float32)\
        .amx_takes(torch.zeros(16, 64))  # fmt: skip
    with pytest.raises(ValueError, match="AMX"):
        layer.amx(torch.zeros(AMX_MAX_ROWS + 1, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="AMX"):
        layer.amx(torch.zeros(16, 62, dtype=torch.bfloat16))  # K of another weight


@pytest.fixture
def dot_body_gemv(amx_gemv):
    """The kernel at this CPU's level with the AMX body off: the dot-product body that CPUs with
    AVX512-BF16 and no tiles run."""
    assert not amx_gemv.use_amx(False)
    yield amx_gemv
    assert amx_gemv.use_amx(True)


@pytest.mark.parametrize("rows", range(1, MAX_ROWS + 1))
def test_few_rows_take_the_amx_body_for_every_row_count(amx_gemv, rows):
    """bf16 layers of 1-8 rows (the decode loop's) run on the tiles where the CPU has them: the
    same bits as the AMX entry itself, and close to F.linear."""
    torch.manual_seed(rows)
    x = torch.randn(rows, 576).to(torch.bfloat16)
    weight = (torch.randn(960, 576) / 24).to(torch.bfloat16)
    b = torch.randn(960).to(torch.bfloat16)
    layer = amx_gemv.bind(weight, b)
    got = layer(x)
    direct = torch.empty_like(got)
    status = amx_gemv.amx_function(
        x.data_ptr(), layer.kernel_weight.data_ptr(), b.data_ptr(), direct.data_ptr(), rows, 960,
        576, torch.get_num_threads(),
    )  # fmt: skip
    assert status == 0 and torch.equal(got, direct)
    expected = F.linear(x.float(), weight.float(), b.float())
    torch.testing.assert_close(got.float(), expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS])
@pytest.mark.parametrize("n, k", [(960, 576), (13, 100)])
def test_the_dot_body_where_the_tiles_are_off(dot_body_gemv, rows, n, k):
    torch.manual_seed(rows + n)
    x = torch.randn(MAX_ROWS, k).to(torch.bfloat16)
    weight = (torch.randn(n, k) / k**0.5).to(torch.bfloat16)
    layer = dot_body_gemv.bind(weight)
    assert not layer.amx_takes(torch.zeros(16, k, dtype=torch.bfloat16))
    whole = layer(x)
    torch.testing.assert_close(
        whole.float(), F.linear(x.float(), weight.float()), rtol=1e-2, atol=1e-2
    )
    assert torch.equal(layer(x[:rows].clone()), whole[:rows])  # a row alone: the same bits
