"""CPU linear layers give what F.linear gives, with and without bias, at any row count: pre-packed
bf16 linears (only where the ISA level has oneDNN's bf16 path), plain bf16 ones below it, and fp32
math over bf16-stored weights; with and without the few-row kernel at every ISA level. The
kernel's copy of the weights, and the fp32 copies, are kept only where they fit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.cpu_levels import kernel_at
from yaied.kernels.cpu_gemv import AMX_MAX_ROWS, MAX_ROWS, SLICED_MAX_ROWS, BoundLinear, CpuGemv
from yaied.kernels.cpu_isa import selected_level
from yaied.kernels.cpu_matmul import CpuMatmul
from yaied.worker import cpu_linear
from yaied.worker.cpu_linear import (
    Bf16StoredLinear,
    PackedLinear,
    PanelLinear,
    can_pack,
    fp32_copy_fits,
    gemv_fits,
    pack_linears,
    store_linears_bf16,
    store_linears_panels,
)

CPU = torch.device("cpu")
needs_packing = pytest.mark.skipif(
    not can_pack(torch.bfloat16, CPU, selected_level()),
    reason="oneDNN has no bf16 path at this CPU's ISA level",
)


@pytest.fixture
def gemv(isa_level):
    return kernel_at(CpuGemv, isa_level)


@pytest.fixture
def matmul(isa_level):
    return kernel_at(CpuMatmul, isa_level)


def tied_head_model(embed: nn.Embedding, proj: bool = True) -> nn.Module:
    """``embed``, a 64 -> 64 projection (with ``proj``) and an LM head tied to the embedding:
    its weight is the embedding's."""
    model = nn.Module()
    model.embed = embed
    if proj:
        model.proj = nn.Linear(64, 64)
    model.lm_head = nn.Linear(64, embed.num_embeddings, bias=False)
    model.lm_head.weight = embed.weight
    return model


@needs_packing
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 7, 64, 513])
def test_packed_linear_matches_linear(bias, rows):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 160, bias=bias).to(torch.bfloat16)
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    with torch.inference_mode():
        expected = linear(x).float()
        packed = PackedLinear(linear, batch_hint=512)
        got = packed(x).float()
        # [batch, seq, in] as transformers' modules send it, and no rows at all
        got_3d = packed(x.view(1, rows, 96)).float()
        assert packed(x[:0]).shape == (0, 160)
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got_3d, expected.view(1, rows, 160), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("pack", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("rows", [1, 3, 7])
def test_few_rows_is_the_kernel_at_every_level(gemv, pack, rows):
    if pack and not can_pack(torch.bfloat16, CPU, selected_level()):
        pytest.skip("oneDNN has no bf16 path at this CPU's ISA level")
    torch.manual_seed(rows)
    linear = nn.Linear(96, 160).to(torch.bfloat16)
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    with torch.inference_mode():
        expected = linear(x).float()
        layer = PackedLinear(linear, batch_hint=64, gemv=gemv, pack=pack)
        torch.testing.assert_close(layer(x).float(), expected, rtol=2e-2, atol=2e-2)
        if rows <= MAX_ROWS:
            got = layer.few_rows(x).float()
            torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)


@needs_packing
def test_forward_is_onednn_and_few_rows_is_the_kernel():
    # The few-row kernel runs only in the decode loop; forward keeps oneDNN for every row count.
    gemv = kernel_at(CpuGemv, selected_level())
    linear = PackedLinear(nn.Linear(64, 32).to(torch.bfloat16), batch_hint=64, gemv=gemv)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        onednn = torch.ops.mkldnn._linear_pointwise(x, linear.packed, linear.bias, "none", [], "")
        assert torch.equal(linear(x), onednn)
        torch.testing.assert_close(linear.few_rows(x).float(), onednn.float(), rtol=2e-2, atol=2e-2)
    assert PackedLinear(nn.Linear(64, 32).to(torch.bfloat16), batch_hint=64).few_rows is None


@needs_packing
@pytest.mark.parametrize("rows", [MAX_ROWS, MAX_ROWS + 1, 24, AMX_MAX_ROWS, AMX_MAX_ROWS + 1])
def test_forward_takes_the_amx_body_between_the_few_rows_and_onednn(rows):
    """With the tiles, forward runs 9-32 rows on the AMX body (over the few-row kernel's copy
    of the weight) and the rest on oneDNN; both agree with F.linear."""
    gemv = CpuGemv.load()
    if gemv is None or not gemv.amx:
        pytest.skip("no AMX tiles on this CPU (or the kernel was built without them)")
    torch.manual_seed(rows)
    linear = nn.Linear(96, 160).to(torch.bfloat16)
    layer = PackedLinear(linear, batch_hint=64, gemv=gemv)
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    with torch.inference_mode():
        onednn = torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.bias, "none", [], "")
        got = layer(x)
        torch.testing.assert_close(got.float(), linear(x).float(), rtol=2e-2, atol=2e-2)
    if MAX_ROWS < rows <= AMX_MAX_ROWS:
        assert torch.equal(got, layer.few_rows.amx(x))
    else:
        assert torch.equal(got, onednn)


@pytest.mark.parametrize(
    "keep_fp32, batch_hint",
    [(True, None), (False, None), (True, 64)],
    ids=["fp32-copy", "widened", "packed"],
)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 4, 5, 130])
def test_bf16_stored_linear_is_fp32_math_over_bf16_weights(gemv, keep_fp32, batch_hint, bias, rows):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 160, bias=bias)
    x = torch.randn(rows, 96)
    rounded = linear.weight.detach().to(torch.bfloat16).float()  # the weight as stored
    expected = F.linear(x, rounded, linear.bias)
    with torch.inference_mode():
        layer = Bf16StoredLinear(linear, gemv, keep_fp32, batch_hint=batch_hint)
        # one bf16 copy: the kernel's (in its layout) where there is a kernel, else the plain one
        assert (layer.weight is None) == (gemv is not None)
        assert torch.equal(layer.bf16_weight().float(), rounded)
        assert (layer.weight_f32 is not None) == (keep_fp32 and batch_hint is None)
        assert (layer.packed_f32 is not None) == (batch_hint is not None)
        got = layer(x)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        if rows <= MAX_ROWS:
            torch.testing.assert_close(layer.few_rows(x), expected, rtol=1e-4, atol=1e-4)
            layer.few_rows_in_forward = True
            assert torch.equal(layer(x), layer.few_rows(x))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 9, 33, 130])
def test_bf16_stored_linear_runs_rows_on_the_panels(gemv, matmul, bias, rows):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 160, bias=bias)
    x = torch.randn(rows, 96)
    rounded = linear.weight.detach().to(torch.bfloat16).float()
    expected = F.linear(x, rounded, linear.bias)
    with torch.inference_mode():
        layer = Bf16StoredLinear(linear, gemv, keep_fp32=True, matmul=matmul)
        # the panels are the fp32 copy: no other
        assert layer.panels is not None and layer.packed_f32 is None and layer.weight_f32 is None
        got = layer(x)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        assert torch.equal(got, layer.panels(x))
        assert torch.equal(layer(x.view(1, rows, 96)), got.view(1, rows, 160))
        layer.drop_matmul_weights()
        assert layer.panels is None


def test_store_linears_bf16_gives_every_layer_and_a_tied_head_panels(gemv, matmul, monkeypatch):
    """From avx2 up, where the fp32 copies fit: the panel matmul's layout for every layer,
    a tied head's too (beside the embedding's fp32 values), which keeps the few-row kernel up
    to MAX_ROWS rows; the generic body is slower than oneDNN, so there nothing changes."""
    torch.manual_seed(2)
    embed = nn.Embedding(40, 64)
    model = tied_head_model(embed)
    x = torch.randn(MAX_ROWS + 1, 64)
    with torch.inference_mode():
        expected = model.lm_head(model.proj(x))
        assert store_linears_bf16(model, gemv, matmul=matmul) == 2
        proj, head = model.proj, model.lm_head
        if not matmul.fast:
            assert proj.panels is None and head.panels is None
            return
        assert proj.panels is not None and proj.packed_f32 is None
        assert head.panels is not None and head.weight_f32.data_ptr() == embed.weight.data_ptr()
        assert head.few_rows_in_forward and head.sliced_max_rows == MAX_ROWS
        hidden = proj(x)
        assert torch.equal(head(hidden[:MAX_ROWS]), head.few_rows(hidden[:MAX_ROWS]))
        got = head(hidden)
        assert torch.equal(got, head.panels(hidden))
        torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)
    # where the tied head's copy does not fit beside the rest, only the head goes without
    monkeypatch.setattr(
        cpu_linear, "fp32_copy_fits", lambda model, tied_heads=False: not tied_heads
    )
    model = tied_head_model(embed)
    with torch.inference_mode():
        store_linears_bf16(model, gemv, matmul=matmul)
    assert model.proj.panels is not None and model.lm_head.panels is None


@pytest.mark.parametrize("bias", [False, True])
def test_fp32_weights_run_every_row_count_on_the_panels(matmul, bias):
    """--dtype float32 over fp32 weights: the panels replace the weight (not rounded to bf16)
    and take 1 row as they take 130, each row the same bits alone and in the batch."""
    torch.manual_seed(3)
    linear = nn.Linear(96, 160, bias=bias)
    x = torch.randn(130, 96)
    with torch.inference_mode():
        expected = F.linear(x.double(), linear.weight.double(),
                            None if linear.bias is None else linear.bias.double())  # fmt: skip
        layer = PanelLinear(linear, matmul)
        got = layer(x)
        torch.testing.assert_close(got, expected.float(), rtol=1e-5, atol=1e-5)
        assert all(torch.equal(layer(x[r : r + 1]), got[r : r + 1]) for r in (0, 7, 129))
        assert torch.equal(layer(x.view(2, 65, 96)), got.view(2, 65, 160))
        assert layer(x[:0]).shape == (0, 160)


def test_store_linears_panels_replaces_the_weights_and_a_tied_head_where_it_fits(
    matmul, monkeypatch
):
    torch.manual_seed(4)
    embed = nn.Embedding(40, 64)
    model = tied_head_model(embed)
    x = torch.randn(5, 64)
    with torch.inference_mode():
        expected = model.lm_head(model.proj(x))
        replaced = store_linears_panels(model, matmul)
        if not matmul.fast:  # the generic body: F.linear stays
            assert replaced == 0 and isinstance(model.proj, nn.Linear)
            return
        assert replaced == 2
        assert isinstance(model.proj, PanelLinear) and isinstance(model.lm_head, PanelLinear)
        torch.testing.assert_close(model.lm_head(model.proj(x)), expected, rtol=1e-5, atol=1e-5)
        assert embed.weight.shape == (40, 64)  # the embedding keeps its own
    # where the head's copy does not fit, the head stays on F.linear over the embedding's
    monkeypatch.setattr(cpu_linear, "_fits", lambda extra, share: extra == 0)
    model = tied_head_model(embed)
    with torch.inference_mode():
        assert store_linears_panels(model, matmul) == 1
    assert isinstance(model.proj, PanelLinear) and isinstance(model.lm_head, nn.Linear)


def test_store_linears_bf16_wraps_every_linear_and_the_head_takes_the_kernel(gemv):
    torch.manual_seed(0)
    embed = nn.Embedding(10, 64)
    model = tied_head_model(embed)  # tied: the head's fp32 weight is the embedding's
    x = torch.randn(3, 64)
    with torch.inference_mode():
        expected = model.lm_head(model.proj(x))
        assert store_linears_bf16(model, gemv) == 2
        got = model.lm_head(model.proj(x))
    assert isinstance(model.proj, Bf16StoredLinear) and not model.proj.few_rows_in_forward
    assert model.proj.packed_f32 is not None  # oneDNN's layout, packed once (not MKL per call)
    assert model.lm_head.few_rows_in_forward
    # no second fp32 copy of a tied head: the embedding's, rounded to the bf16 values in place
    assert model.lm_head.weight_f32.data_ptr() == embed.weight.data_ptr()
    assert torch.equal(embed.weight.detach(), model.lm_head.bf16_weight().float())
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)


def test_a_head_without_a_packed_copy_takes_the_kernel_in_slices(gemv, monkeypatch):
    # A tied head's matmul would re-pack the embedding's fp32 weight every call: from avx2 up
    # it takes the kernel MAX_ROWS rows at a time up to SLICED_MAX_ROWS (each row its bits
    # alone); the generic body only up to MAX_ROWS; a head with an fp32 copy in oneDNN's
    # layout keeps the matmul past MAX_ROWS.
    torch.manual_seed(1)
    embed = nn.Embedding(40, 64)
    model = tied_head_model(embed, proj=False)
    with torch.inference_mode():
        store_linears_bf16(model, gemv)
        head = model.lm_head
        limit = SLICED_MAX_ROWS if gemv.level != "generic" else MAX_ROWS
        assert head.packed_f32 is None and head.sliced_max_rows == limit
        x = torch.randn(limit + 1, 64)
        rows = min(2 * MAX_ROWS + 1, limit)
        got = head(x[:rows])
        assert all(torch.equal(got[r], head.few_rows(x[r : r + 1])[0]) for r in range(rows))
        taken = []
        monkeypatch.setattr(BoundLinear, "in_slices", lambda self, x: taken.append(x) or x)
        head(x[:limit])
        assert len(taken) == 1
        expected = F.linear(x, head.bf16_weight().float())
        torch.testing.assert_close(head(x), expected, rtol=1e-4, atol=1e-4)  # the matmul
        assert len(taken) == 1
        if cpu_linear._onednn_linear_available():  # an fp32 copy in oneDNN's layout
            untied = Bf16StoredLinear(nn.Linear(64, 40), gemv, keep_fp32=True, batch_hint=64)
            assert untied.sliced_max_rows == MAX_ROWS
            untied.few_rows_in_forward = True
            untied(x[: MAX_ROWS + 1])
            assert len(taken) == 1


def test_the_copies_are_kept_only_where_they_fit(monkeypatch):
    # 2 linears of 64 x 32 and a head tied to the embedding: the kernel's copy (its own
    # layout) covers the head too; the fp32 copies do not (the head's is the embedding)
    embed = nn.Embedding(10, 64)
    head = nn.Linear(64, 10, bias=False)
    head.weight = embed.weight
    model = nn.ModuleList([embed, nn.Linear(64, 32), nn.Linear(32, 64), head])
    bf16_copy, fp32_copy = (2 * 64 * 32 + 10 * 64) * 2, 2 * 64 * 32 * 4
    pages = {"SC_PAGE_SIZE": 1}
    monkeypatch.setattr(cpu_linear.os, "sysconf", lambda name: pages.get(name, memory[0]))
    memory = [int(bf16_copy / cpu_linear.GEMV_MEMORY_SHARE)]
    assert gemv_fits(model)
    memory = [memory[0] - 16]
    assert not gemv_fits(model)
    memory = [int(fp32_copy / cpu_linear.FP32_COPY_MEMORY_SHARE)]
    assert fp32_copy_fits(model)
    assert not fp32_copy_fits(model, tied_heads=True)  # the panel matmul copies the head too
    memory = [int((fp32_copy + 10 * 64 * 4) / cpu_linear.FP32_COPY_MEMORY_SHARE)]
    assert fp32_copy_fits(model, tied_heads=True)
    memory = [int(fp32_copy / cpu_linear.FP32_COPY_MEMORY_SHARE) - 16]
    assert not fp32_copy_fits(model)


@pytest.mark.parametrize("pack", [False, True], ids=["plain", "packed"])
def test_pack_linears_replaces_every_linear(pack):
    if pack and not can_pack(torch.bfloat16, CPU, selected_level()):
        pytest.skip("oneDNN has no bf16 path at this CPU's ISA level")
    model = nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.Linear(16, 4, bias=False))
    model = model.to(torch.bfloat16)
    x = torch.randn(5, 8, dtype=torch.bfloat16)
    with torch.inference_mode():
        expected = model(x).float()
        assert pack_linears(model, batch_hint=64, pack=pack) == 2
        got = model(x).float()
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("pack", [False, True], ids=["plain", "packed"])
def test_the_bf16_lm_head_takes_the_kernel_for_few_rows(gemv, pack):
    if pack and not can_pack(torch.bfloat16, CPU, selected_level()):
        pytest.skip("oneDNN has no bf16 path at this CPU's ISA level")
    model = nn.Module()
    model.proj = nn.Linear(64, 64).to(torch.bfloat16)
    model.lm_head = nn.Linear(64, 40, bias=False).to(torch.bfloat16)
    x = torch.randn(MAX_ROWS + 1, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        expected = F.linear(x, model.lm_head.weight).float()
        assert pack_linears(model, batch_hint=64, gemv=gemv, pack=pack) == 2
        head = model.lm_head
        assert head.few_rows_in_forward and not model.proj.few_rows_in_forward
        for rows in (1, 3, MAX_ROWS):
            assert torch.equal(head(x[:rows]), head.few_rows(x[:rows]))  # the kernel, not oneDNN
        torch.testing.assert_close(head(x).float(), expected, rtol=2e-2, atol=2e-2)  # past it
    assert not PackedLinear(nn.Linear(8, 8).to(torch.bfloat16), 64, gemv).few_rows_in_forward


def test_packing_is_decided_by_the_isa_level_not_by_trying():
    assert not can_pack(torch.bfloat16, CPU, "avx2")
    assert not can_pack(torch.bfloat16, CPU, "generic")
    assert not can_pack(torch.float32, CPU, "avx512_bf16")
