"""Pre-packed bf16 linears give what F.linear gives, with and without bias, at any row count, with
and without the few-row kernel; the kernel's copy of the weights is kept only where it fits."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from yaied.kernels.cpu_gemv import MAX_ROWS, CpuGemv
from yaied.worker import cpu_linear
from yaied.worker.cpu_linear import PackedLinear, can_pack, gemv_fits, pack_linears

pytestmark = pytest.mark.skipif(
    not can_pack(torch.bfloat16, torch.device("cpu")), reason="oneDNN bf16 linear unavailable"
)


gemv = CpuGemv.load()


@pytest.mark.parametrize("few_rows_kernel", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 7, 64, 513])
def test_packed_linear_matches_linear(few_rows_kernel, bias, rows):
    if few_rows_kernel and gemv is None:
        pytest.skip("no C compiler for the few-row kernel")
    torch.manual_seed(rows)
    linear = nn.Linear(96, 160, bias=bias).to(torch.bfloat16)
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    with torch.inference_mode():
        expected = linear(x).float()
        packed = PackedLinear(linear, batch_hint=512, gemv=gemv if few_rows_kernel else None)
        got = packed(x).float()
        # [batch, seq, in] as transformers' modules send it, and no rows at all
        got_3d = packed(x.view(1, rows, 96)).float()
        assert packed(x[:0]).shape == (0, 160)
        if few_rows_kernel and rows <= MAX_ROWS:
            got_few = packed.few_rows(x).float()
            torch.testing.assert_close(got_few, expected, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got_3d, expected.view(1, rows, 160), rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(gemv is None, reason="no C compiler for the few-row kernel")
def test_forward_is_onednn_and_few_rows_is_the_kernel():
    # The few-row kernel runs only in the decode loop; forward keeps oneDNN for every row count.
    linear = PackedLinear(nn.Linear(64, 32).to(torch.bfloat16), batch_hint=64, gemv=gemv)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        onednn = torch.ops.mkldnn._linear_pointwise(x, linear.packed, linear.bias, "none", [], "")
        assert torch.equal(linear(x), onednn)
        torch.testing.assert_close(linear.few_rows(x).float(), onednn.float(), rtol=2e-2, atol=2e-2)
    assert PackedLinear(nn.Linear(64, 32).to(torch.bfloat16), batch_hint=64).few_rows is None


def test_the_second_copy_is_kept_only_where_it_fits(monkeypatch):
    # 2 linears of 64 x 32 bf16 (the tied head shares the embedding and costs nothing)
    embed = nn.Embedding(10, 64)
    head = nn.Linear(64, 10, bias=False)
    head.weight = embed.weight
    model = nn.ModuleList([embed, nn.Linear(64, 32), nn.Linear(32, 64), head])
    model = model.to(torch.bfloat16)
    extra = 2 * 64 * 32 * 2
    pages = {"SC_PAGE_SIZE": 1}
    monkeypatch.setattr(cpu_linear.os, "sysconf", lambda name: pages.get(name, memory[0]))
    memory = [int(extra / cpu_linear.GEMV_MEMORY_SHARE)]
    assert gemv_fits(model)
    memory = [memory[0] - 16]
    assert not gemv_fits(model)


def test_pack_linears_replaces_every_linear():
    model = nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.Linear(16, 4, bias=False))
    model = model.to(torch.bfloat16)
    x = torch.randn(5, 8, dtype=torch.bfloat16)
    with torch.inference_mode():
        expected = model(x).float()
        assert pack_linears(model, batch_hint=64) == 2
        got = model(x).float()
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)
