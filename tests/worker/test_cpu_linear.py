"""Pre-packed bf16 linears give what F.linear gives, with and without bias, at any row count."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from yaied.worker.cpu_linear import PackedLinear, can_pack, pack_linears

pytestmark = pytest.mark.skipif(
    not can_pack(torch.bfloat16, torch.device("cpu")), reason="oneDNN bf16 linear unavailable"
)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 64, 513])
def test_packed_linear_matches_linear(bias, rows):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 160, bias=bias).to(torch.bfloat16)
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    with torch.inference_mode():
        expected = linear(x).float()
        got = PackedLinear(linear, batch_hint=512)(x).float()
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)


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
