"""oneDNN's matmuls see a bounded set of row counts (yaied/worker/onednn_rows.py): the packed
linears and the quantized path's bf16 matmuls."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from yaied.kernels.cpu_isa import selected_level
from yaied.kernels.cpu_quant import Q8_0, CpuQuant, quantize
from yaied.worker import quantized
from yaied.worker.cpu_linear import Bf16StoredLinear, PackedLinear, can_pack
from yaied.worker.onednn_rows import EXACT_ROWS, padded_rows
from yaied.worker.quantized import QuantizedLinear

needs_packing = pytest.mark.skipif(
    not can_pack(torch.bfloat16, torch.device("cpu"), selected_level()),
    reason="oneDNN has no bf16 path at this CPU's ISA level",
)


def test_padded_rows_are_few_and_close_above():
    sizes = {padded_rows(rows) for rows in range(1, 4097)}
    # every count up to EXACT_ROWS, then 8 sizes for each doubling: 33-64, ..., 2049-4096
    assert len(sizes) == EXACT_ROWS + 8 * 7
    for rows in range(1, 4097):
        padded = padded_rows(rows)
        assert rows <= padded <= max(rows, rows * 9 // 8)
        assert padded_rows(padded) == padded


def _record_onednn_rows(monkeypatch) -> list[int]:
    """The row counts every call of oneDNN's packed linear gets from here on."""
    seen: list[int] = []
    real = torch.ops.mkldnn._linear_pointwise

    def recording(x, *args):
        seen.append(x.reshape(-1, x.shape[-1]).shape[0])
        return real(x, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", recording)
    return seen


@needs_packing
def test_every_prefill_row_count_reaches_onednn_as_one_of_few_shapes(monkeypatch):
    """Each shape oneDNN meets is a primitive its caches keep (1024 of them, ~0.6 MiB each for
    the default model): a step of every row count up to 600 must not make 600 of them."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 48).to(torch.bfloat16)
    layer = PackedLinear(linear, batch_hint=64)
    seen = _record_onednn_rows(monkeypatch)
    x = torch.randn(600, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        for rows in range(1, 601):
            got = layer(x[:rows])
            assert got.shape == (rows, 48)
            if rows in (33, 100, 513, 600):  # padded, and not: the rows' own results
                torch.testing.assert_close(
                    got.float(), linear(x[:rows]).float(), rtol=2e-2, atol=2e-2
                )
        got_3d = layer(x[:77].view(1, 77, 64))
    expected_3d = linear(x[:77]).view(1, 77, 48).float()
    torch.testing.assert_close(got_3d.float(), expected_3d, rtol=2e-2, atol=2e-2)
    assert len(set(seen)) <= EXACT_ROWS + 8 * 5  # 33-64, ..., 513-1024
    assert all(rows <= EXACT_ROWS or rows % 4 == 0 for rows in seen)


@needs_packing
def test_the_fp32_packed_copy_is_padded_too(monkeypatch):
    torch.manual_seed(1)
    linear = nn.Linear(64, 48)
    layer = Bf16StoredLinear(linear, None, keep_fp32=True, batch_hint=64)
    assert layer.packed_f32 is not None
    seen = _record_onednn_rows(monkeypatch)
    x = torch.randn(100, 64)
    with torch.inference_mode():
        got = layer(x)
        expected = nn.functional.linear(x, layer.weight.float(), layer.bias)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert seen == [104]


def _record_matmul_rows(monkeypatch) -> list[int]:
    """The activations' row counts of every plain matmul (F.linear, torch.mm, torch.addmm) from
    here on: a bf16 one goes to oneDNN, a primitive per shape."""
    seen: list[int] = []
    for owner, name, index in ((F, "linear", 0), (torch, "mm", 0), (torch, "addmm", 1)):
        real = getattr(owner, name)

        def recording(*args, _real=real, _index=index, **kwargs):
            seen.append(args[_index].reshape(-1, args[_index].shape[-1]).shape[0])
            return _real(*args, **kwargs)

        monkeypatch.setattr(owner, name, recording)
    return seen


@pytest.mark.parametrize("tiled", [False, True], ids=["whole", "tiles"])
def test_the_quantized_path_pads_its_bf16_matmuls_and_keeps_the_rows_bits(monkeypatch, tiled):
    """QuantizedLinear's matmuls of many rows on the unpacked weight (worker/quantized.py): in
    bf16 every row count up to 600 reaches the matmul as one of few shapes, and each real row's
    result is the bits of the unpadded call (whole weight: F.linear; in tiles: mm/addmm)."""
    if tiled:
        # 4 KiB: tiles of 64 weight rows (the least a tile has) of the 80
        monkeypatch.setattr(quantized, "TILE_BYTES", 4096)
    torch.manual_seed(2)
    n, k = 80, 64
    layer = QuantizedLinear(Q8_0, quantize(torch.randn(n, k) / 8, Q8_0), k, torch.randn(n))
    layer.bind(CpuQuant.load(), torch.bfloat16)
    assert (layer.tile_rows(2) < n) == tiled
    weight, bias = layer.unpacked(torch.bfloat16).clone(), layer.bias
    x = torch.randn(600, k, dtype=torch.bfloat16)
    with torch.inference_mode():
        expected = [F.linear(x[:rows], weight, bias) for rows in range(1, 601)]
        seen = _record_matmul_rows(monkeypatch)
        for rows in range(1, 601):
            got = layer(x[:rows])
            assert got.shape == (rows, n) and torch.equal(got, expected[rows - 1]), rows
        got_3d = layer(x[:77].view(1, 77, k))
    assert torch.equal(got_3d, expected[76].view(1, 77, n))
    assert len(set(seen)) <= EXACT_ROWS + 8 * 5  # 33-64, ..., 513-1024
    assert all(rows <= EXACT_ROWS or rows % 4 == 0 for rows in seen)
