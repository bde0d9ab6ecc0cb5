"""Block-quantized weights (cpu_quant.c, cpu_quant.py): the torch reference against gguf-py's own
unpacking, the packer's round trip, and the C kernels at every ISA level against the reference:
unpacking to fp32 and bf16 bit for bit, the few-row linear against the fp32 linear over the
unpacked weights (which it computes up to the order of fp32 sums), a row's bits alone and in a
batch, the fused norm and SiLU, and the refusals."""

from __future__ import annotations

import gguf
import pytest
import torch
import torch.nn.functional as F

from tests.cpu_levels import kernel_at
from yaied.kernels import cpu_isa
from yaied.kernels.cpu_fused import CpuFusedOps
from yaied.kernels.cpu_isa import runnable_levels
from yaied.kernels.cpu_quant import (
    GROUPED,
    IQ4_NL,
    IQ4_XS,
    MAX_ROWS,
    PACKABLE,
    Q2_K,
    Q3_K,
    Q4_0,
    Q4_0_GROUPED,
    Q4_1,
    Q4_1_GROUPED,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_0,
    QUANT_TYPES,
    STACKED,
    UNGROUPED,
    CpuQuant,
    QuantType,
    dequantize_reference,
    group_blocks,
    quantize,
    row_bytes,
    ungroup_blocks,
)

TYPES = pytest.mark.parametrize("qtype", list(QUANT_TYPES.values()), ids=list(QUANT_TYPES))
# ... and the layouts the kernels keep Q4_0 and Q4_1 in
KERNEL_TYPES = pytest.mark.parametrize(
    "qtype",
    [*QUANT_TYPES.values(), Q4_0_GROUPED, Q4_1_GROUPED],
    ids=[*QUANT_TYPES, "q4_0_grouped", "q4_1_grouped"],
)
K_TYPES = pytest.mark.parametrize(
    "qtype",
    [Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS],
    ids=["q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs"],
)
# ... and the types read with scales of their own for each 32 (IQ4_NL: one d a block)
SCALED_TYPES = pytest.mark.parametrize(
    "qtype",
    [Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS, IQ4_NL],
    ids=["q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs", "iq4_nl"],
)
# Where a type keeps its fp16 d (and dmin after it, where it has one), and how many bytes the two
# take: Q4_K and Q5_K start with them, Q2_K, Q3_K and Q6_K end with them, the IQ4 types start with
# d alone
D_AT = {Q2_K: (80, 4), Q3_K: (108, 2), Q6_K: (208, 2), IQ4_NL: (0, 2), IQ4_XS: (0, 2)}


@pytest.fixture
def quant(isa_level):
    return kernel_at(CpuQuant, isa_level)


def table(qtype: QuantType, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """A block table: packed by yaied for Q8_0/Q4_0, random bytes with sane fp16 scales for
    Q4_1 and the K types (whose every bit pattern is a valid block; D_AT: where d is)."""
    if qtype in UNGROUPED:
        return group_blocks(UNGROUPED[qtype], table(UNGROUPED[qtype], n, k, seed))[1]
    generator = torch.Generator().manual_seed(seed)
    if qtype in PACKABLE:
        return quantize(torch.randn(n, k, generator=generator) / k**0.5, qtype)
    blocks = torch.randint(0, 256, (n, row_bytes(qtype, k)), generator=generator, dtype=torch.uint8)
    view = blocks.view(n, -1, qtype.block_bytes)
    count = view.shape[1]
    scales = (torch.rand(n, count, generator=generator) * 0.02 + 0.001).half()
    if qtype is Q6_K:  # d after int8 scales of up to 128: the same weights' magnitude
        view[..., 208:210] = (scales.float() / 64).half().view(torch.uint8).view(n, count, 2)
        return blocks
    if qtype is Q3_K:  # d after scales of -32..31 times quants of -4..3
        view[..., 108:110] = (scales.float() / 8).half().view(torch.uint8).view(n, count, 2)
        return blocks
    if qtype in (IQ4_NL, IQ4_XS):  # values up to 127 (IQ4_XS: times scales of -32..31)
        d = scales.float() / (64 if qtype is IQ4_NL else 1024)
        view[..., 0:2] = d.half().view(torch.uint8).view(n, count, 2)
        return blocks
    at = D_AT[qtype][0] if qtype in D_AT else 0
    view[..., at : at + 2] = scales.view(torch.uint8).view(n, count, 2)
    second = (torch.rand(n, count, generator=generator) * 0.05).half()
    if qtype is Q4_1:
        second = -second
    if qtype in (Q4_1, Q2_K, Q4_K, Q5_K):
        view[..., at + 2 : at + 4] = second.view(torch.uint8).view(n, count, 2)
    return blocks


@TYPES
def test_reference_unpacks_as_gguf_does(qtype):
    blocks = table(qtype, 7, 512, seed=1)
    expected = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType(qtype.ggml_id))
    assert torch.equal(dequantize_reference(qtype, blocks, 512), torch.from_numpy(expected.copy()))


@pytest.mark.parametrize("qtype", PACKABLE, ids=[t.name for t in PACKABLE])
def test_packing_round_trip(qtype):
    torch.manual_seed(0)
    weight = torch.randn(64, 256)
    blocks = quantize(weight, qtype)
    assert blocks.shape == (64, row_bytes(qtype, 256)) and blocks.dtype == torch.uint8
    back = dequantize_reference(qtype, blocks, 256)
    amax = weight.reshape(64, 8, 32).abs().amax(-1, keepdim=True)
    amax = amax.expand(-1, -1, 32).reshape(64, 256)
    # half a step (Q4_0: a whole one at the clamped end opposite the block's largest value)
    bound = amax / 127 * 0.5 if qtype is Q8_0 else amax / 8
    assert ((back - weight).abs() <= bound * 1.01 + 1e-6).all()
    # gguf-py packs the same formats; its weights unpack to within one of our steps of ours
    theirs = gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType(qtype.ggml_id))
    unpacked = gguf.quants.dequantize(theirs, gguf.GGMLQuantizationType(qtype.ggml_id))
    assert ((torch.from_numpy(unpacked.copy()) - back).abs() <= 2 * bound * 1.01 + 1e-6).all()


@KERNEL_TYPES
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_unpacks_as_the_reference(quant, qtype, dtype):
    k = 768 if qtype.block_size == 32 else 1024
    blocks = table(qtype, 19, k, seed=2)
    expected = dequantize_reference(qtype, blocks, k).to(dtype)
    assert torch.equal(quant.dequantize(qtype, blocks, k, dtype), expected)
    buffer = torch.empty(19 * k + 5, dtype=dtype)
    assert torch.equal(quant.dequantize(qtype, blocks, k, dtype, out=buffer), expected)


@SCALED_TYPES
@pytest.mark.parametrize("super_blocks", [1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_k_types_unpack_bit_for_bit_over_any_scales(quant, qtype, super_blocks, dtype):
    """The K and IQ4 types' unpacking (a vector body per level) against the reference bit for
    bit, signed zeros too, over every byte random but the fp16 d and dmin, drawn from all finite
    fp16 values of either sign (subnormals too): an odd count of rows, 1 to 8 super-blocks
    (IQ4_NL: 8 to 64 blocks)."""
    k, n = 256 * super_blocks, 7
    generator = torch.Generator().manual_seed(super_blocks)
    blocks = torch.randint(0, 256, (n, row_bytes(qtype, k)), generator=generator, dtype=torch.uint8)
    view = blocks.view(n, -1, qtype.block_bytes)
    count = view.shape[1]
    halves = torch.randint(0, 1 << 16, (n, count, 2), generator=generator, dtype=torch.int32)
    halves = halves.to(torch.int16).view(torch.float16)
    halves = torch.where(halves.isfinite(), halves, torch.zeros_like(halves))
    at, size = D_AT.get(qtype, (0, 4))
    view[..., at : at + size] = halves[..., : size // 2].contiguous().view(torch.uint8)
    expected = dequantize_reference(qtype, blocks, k).to(dtype)
    got = quant.dequantize(qtype, blocks, k, dtype)
    bits = torch.int32 if dtype is torch.float32 else torch.int16
    assert torch.equal(got.view(bits), expected.view(bits))


@KERNEL_TYPES
@pytest.mark.parametrize("rows", [1, 2, 3, 5, MAX_ROWS])
@pytest.mark.parametrize("n", [1, 13, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_the_reference_linear(quant, qtype, rows, n, bias):
    k = 512
    blocks = table(qtype, n, k, seed=rows + n)
    torch.manual_seed(rows * 100 + n)
    x = torch.randn(rows, k)
    b = torch.randn(n) if bias else None
    expected = F.linear(x, dequantize_reference(qtype, blocks, k), b)
    got = quant.bind(qtype, blocks, k, b)(x)
    assert got.shape == (rows, n)
    # fp32 sums in another order: a few ulps of the terms' magnitude
    scale = (x.abs() @ dequantize_reference(qtype, blocks, k).abs().T).max().item()
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5 * scale + 1e-6)


@pytest.mark.parametrize(
    "qtype",
    [Q8_0, Q4_0, Q4_0_GROUPED, Q4_1, Q4_1_GROUPED, IQ4_NL],
    ids=["q8_0", "q4_0", "q4_0_grouped", "q4_1", "q4_1_grouped", "iq4_nl"],
)
@pytest.mark.parametrize("blocks_per_row", [1, 2, 4, 5, 15, 16, 17, 18, 20, 33])
def test_every_count_of_blocks_in_a_row(quant, qtype, blocks_per_row):
    """The scales of a row's blocks are read 16 at a time, the last few (up to 4) one by one
    at avx512: rows of 1 to 33 blocks take every path (the default model's K = 576 is 18)."""
    k, n = 32 * blocks_per_row, 7
    blocks = table(qtype, n, k, seed=blocks_per_row)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(blocks_per_row))
    reference = dequantize_reference(qtype, blocks, k)
    got = quant.bind(qtype, blocks, k)(x)
    scale = (x.abs() @ reference.abs().T).max().item()
    torch.testing.assert_close(got, F.linear(x, reference), rtol=0, atol=1e-5 * scale + 1e-6)


@K_TYPES
@pytest.mark.parametrize("super_blocks", [1, 2, 3, 8])
def test_every_count_of_super_blocks_in_a_row(quant, qtype, super_blocks):
    """The K types' fp32 bodies over rows of 1 to 8 super-blocks of 256 (a 1B model's 2048 is
    8), one row and a batch."""
    k, n = 256 * super_blocks, 9
    blocks = table(qtype, n, k, seed=super_blocks)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(super_blocks))
    reference = dequantize_reference(qtype, blocks, k)
    scale = (x.abs() @ reference.abs().T).max().item()
    for rows in (1, 3):
        got = quant.bind(qtype, blocks, k)(x[:rows])
        torch.testing.assert_close(
            got, F.linear(x[:rows], reference), rtol=0, atol=1e-5 * scale + 1e-6
        )


@KERNEL_TYPES
def test_bf16_activations(quant, qtype):
    k, n = 256, 40
    blocks = table(qtype, n, k, seed=5)
    x = torch.randn(3, k).to(torch.bfloat16)
    bias = torch.randn(n).to(torch.bfloat16)
    expected = F.linear(x.float(), dequantize_reference(qtype, blocks, k)) + bias.float()
    got = quant.bind(qtype, blocks, k, bias, torch.bfloat16)(x)
    assert got.dtype == torch.bfloat16
    # one bf16 rounding of the fp32 result
    torch.testing.assert_close(got.float(), expected, rtol=1e-2, atol=1e-2 * expected.abs().max())


@pytest.mark.parametrize(
    "qtype",
    [Q4_0, Q4_0_GROUPED, Q4_1, Q4_1_GROUPED, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS],
    ids=[
        "q4_0",
        "q4_0_grouped",
        "q4_1",
        "q4_1_grouped",
        "q2_k",
        "q3_k",
        "q4_k",
        "q5_k",
        "q6_k",
        "iq4_nl",
        "iq4_xs",
    ],
)
@pytest.mark.parametrize("blocks_per_row", [1, 2, 5, 16, 17, 18, 33, 64])
def test_bf16_activations_are_one_rounding_off_fp32(quant, qtype, blocks_per_row):
    """bf16 activations meet Q4, the K and the IQ4 types' blocks in bf16 dot products where the
    level has them (each quant as 128 + q, the 128 taken off through the activations' pair sums,
    Q6_K's -32 and Q3_K's -4 too; the IQ4 types' values are bf16 themselves): the products are
    exact, so the result is the fp32 one over the same bf16 values, rounded once to bf16, a bf16
    step apart at most where the fp32 sums' order tips a rounding.
    (The K types and IQ4_XS: rows of 1 to 8 super-blocks.)"""
    assert_one_rounding_off_fp32(quant, qtype, blocks_per_row)


@pytest.mark.skipif("avx512_bf16" not in runnable_levels(), reason="no AVX512-BF16 here")
@pytest.mark.parametrize("qtype", [Q4_0, Q4_1, Q4_1_GROUPED], ids=["q4_0", "q4_1", "q4_1_grouped"])
def test_the_bf16_bodies_without_byte_permutes(monkeypatch, tmp_path, qtype):
    """This CPU's own level is built with -march=native; a CPU with BF16 but no AVX512-VBMI
    (Cooper Lake) builds avx512_bf16 with the level's flags only, where Q4_1 takes its scales a
    block at a time instead of 16 through byte permutes. That build, run here, computes as
    the other does (rows of 16 to 64 blocks: full groups of 16 and tails)."""
    monkeypatch.setattr(cpu_isa, "detected_level", lambda: "avx512")  # -> portable flags
    portable = CpuQuant.load("avx512_bf16", tmp_path, strict=True)
    for blocks_per_row in (16, 18, 33, 64):
        assert_one_rounding_off_fp32(portable, qtype, blocks_per_row)


def assert_one_rounding_off_fp32(quant, qtype, blocks_per_row):
    k, n = 32 * blocks_per_row, 300
    if qtype.block_size == 256:
        k = 256 * (blocks_per_row % 8 + 1)
    blocks = table(qtype, n, k, seed=blocks_per_row + 40)
    x = torch.randn(MAX_ROWS, k, generator=torch.Generator().manual_seed(blocks_per_row))
    x = x.to(torch.bfloat16)
    reference = dequantize_reference(qtype, blocks, k).double()
    expected = F.linear(x.double(), reference)
    got = quant.bind(qtype, blocks, k, None, torch.bfloat16)(x).double()
    step = expected.abs().clamp_min(1e-30).log2().floor().exp2() / 128  # one bf16 ulp
    # fp32 sums of terms up to 143 times the weights' (measured: 5e-7 of the terms' magnitude)
    noise = 4e-6 * (x.double().abs() @ reference.abs().T)
    assert ((got - expected).abs() <= step + noise).all()
    # and nearly every output is the nearest bf16 itself (measured: 99.96% and up)
    assert (got == expected.to(torch.bfloat16).double()).float().mean() > 0.98


STACKS = {
    "q4_k_m": [(Q4_K, 128), (Q6_K, 64)],  # a Q4_K_M file's q, k in Q4_K and v in Q6_K
    "q3_k_m": [(Q3_K, 128), (Q5_K, 64)],  # a Q3_K_M file's q, k in Q3_K and v in Q5_K
    "q2_k": [(Q2_K, 128), (Q3_K, 64), (Q4_K, 8)],  # llama.cpp's Q2_K: v in Q3_K or Q4_K
    "iq4": [(IQ4_XS, 128), (IQ4_NL, 64), (Q6_K, 8)],  # IQ4_XS with IQ4_NL where rows are not 256s
    "five": [(Q4_0_GROUPED, 40), (Q6_K, 8), (Q8_0, 24), (Q4_K, 1), (Q5_K, 3)],  # Q8_0: no bf16
}


@pytest.mark.parametrize("stack", list(STACKS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_stacked_parts_are_each_parts_kernel(quant, stack, dtype):
    """A weight stacked from parts of different types computes each part's rows as that part
    bound alone does, into its own columns with its own bias, up to MAX_ROWS rows (where every
    part has a bf16 body, each takes bf16 activations in it; else all take them in fp32)."""
    k = 512
    parts = [(qtype, table(qtype, n, k, seed=n)) for qtype, n in STACKS[stack]]
    n = sum(blocks.shape[0] for _, blocks in parts)
    x = torch.randn(MAX_ROWS, k, generator=torch.Generator().manual_seed(9)).to(dtype)
    bias = torch.randn(n).to(dtype)
    got = quant.bind_parts(parts, k, bias, dtype)(x)
    first, pieces = 0, []
    for qtype, blocks in parts:
        rows = blocks.shape[0]
        pieces.append(quant.bind(qtype, blocks, k, bias[first : first + rows], dtype)(x))
        first += rows
    alone = torch.cat(pieces, dim=1)
    if dtype is torch.bfloat16 and stack == "five" and quant.level == "avx512_bf16":
        # Q8_0 has no bf16 body: the other parts too take the activations in fp32 here
        reference = torch.cat([dequantize_reference(t, b, k) for t, b in parts])
        expected = F.linear(x.float(), reference) + bias.float()
        torch.testing.assert_close(got.float(), expected, rtol=1e-2, atol=1e-2)
    else:
        assert torch.equal(got, alone)
    for rows in (1, 3):  # a row's bits alone and in a batch
        assert torch.equal(quant.bind_parts(parts, k, bias, dtype)(x[:rows]), got[:rows])


@pytest.mark.parametrize(
    ("field", "change"),
    [(7, -1), (7, +1), (5, STACKED)],  # rows one short, one over; a stack in a stack
    ids=["rows-short", "rows-over", "nested"],
)
def test_a_stacked_descriptor_that_does_not_make_its_weight_is_refused(quant, field, change):
    """The C side checks the parts it is given: rows that do not add up to the weight's N, or a
    part that is itself a stack, is an error, never a read or write past the tables."""
    k = 512
    parts = [(qtype, table(qtype, n, k, seed=n)) for qtype, n in STACKS["q4_k_m"]]
    bound = quant.bind_parts(parts, k)
    descriptor = bound.descriptor  # [STACKED, 2, type, table, rows, type, table, rows]
    descriptor[field] = change if field == 5 else descriptor[field] + change
    with pytest.raises(RuntimeError, match="status -3"):
        bound(torch.randn(1, k))


@KERNEL_TYPES
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_row_does_not_depend_on_the_other_rows(quant, qtype, dtype):
    k, n = 512, 77
    blocks = table(qtype, n, k, seed=6)
    x = torch.randn(MAX_ROWS, k).to(dtype)
    bound = quant.bind(qtype, blocks, k, None, dtype)
    alone = [bound(x[r : r + 1])[0] for r in range(MAX_ROWS)]
    for rows in range(2, MAX_ROWS + 1):
        together = bound(x[:rows])
        assert all(torch.equal(together[r], alone[r]) for r in range(rows))


@pytest.mark.parametrize("qtype", list(GROUPED), ids=[t.name for t in GROUPED])
@pytest.mark.parametrize("blocks_per_row", [1, 5, 16, 18, 33, 64])
def test_grouped_is_gguf_bit_for_bit(quant, qtype, blocks_per_row):
    """The grouped layout holds GGUF's Q4_0 or Q4_1 blocks, each group's d first, then (Q4_1)
    its m, then its quants (the last group shorter where the row's blocks are not a multiple of
    16): it converts back unchanged, and every kernel computes the very bits it computes over
    GGUF's layout (Q4_1 with bf16 activations: where the CPU has AVX512-VBMI, whose byte
    permutes give GGUF's layout the grouped sums; a CPU without them is one rounding off)."""
    k, head = 32 * blocks_per_row, qtype.block_bytes - 16
    blocks = table(qtype, 300, k, seed=blocks_per_row)  # enough rows to meet a rounding tie
    grouped_type, grouped = group_blocks(qtype, blocks)
    assert grouped_type is GROUPED[qtype] and grouped.shape == blocks.shape
    back_type, back = ungroup_blocks(grouped_type, grouped)
    assert back_type is qtype and torch.equal(back, blocks)
    if blocks_per_row == 18:  # two groups: 16 blocks' heads and quants, then 2 blocks'
        view = blocks.view(300, 18, qtype.block_bytes)
        assert torch.equal(grouped[:, :32], view[:, :16, :2].reshape(300, 32))  # d
        if head == 4:
            assert torch.equal(grouped[:, 32:64], view[:, :16, 2:4].reshape(300, 32))  # m
        quants = 16 * head
        assert torch.equal(grouped[:, quants : quants + 256], view[:, :16, head:].reshape(300, 256))
        second = 16 * qtype.block_bytes
        assert torch.equal(grouped[:, second : second + 4], view[:, 16:, :2].reshape(300, 4))
    permutes = "avx512vbmi" in cpu_isa.cpu_features()
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(
            quant.dequantize(grouped_type, grouped, k, dtype),
            quant.dequantize(qtype, blocks, k, dtype),
        )
        x = torch.randn(5, k, generator=torch.Generator().manual_seed(k)).to(dtype)
        for rows in (1, 5):
            expected = quant.bind(qtype, blocks, k, None, dtype)(x[:rows])
            got = quant.bind(grouped_type, grouped, k, None, dtype)(x[:rows])
            bf16_sums = dtype is torch.bfloat16 and quant.level == "avx512_bf16"
            if qtype is Q4_1 and bf16_sums and not permutes:
                torch.testing.assert_close(got.float(), expected.float(), rtol=1e-2, atol=1e-2)
            else:
                assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_delta", [False, True])
@pytest.mark.parametrize("silu", [False, True])
def test_normed_is_the_fused_kernels_then_the_linear(quant, dtype, with_delta, silu):
    ops = kernel_at(CpuFusedOps, quant.level)
    torch.manual_seed(1)
    rows, k, n = 3, 256, 2 * 40
    blocks = table(Q4_K, n, k, seed=7)
    bias = torch.randn(n).to(dtype)
    norm_weight = (1 + torch.randn(k) / 4).to(dtype)
    residual = torch.randn(rows, k).to(dtype)
    delta = torch.randn(rows, k).to(dtype) if with_delta else None
    bound = quant.bind(Q4_K, blocks, k, bias, dtype)
    expected_residual = residual.clone()
    expected = bound(ops.add_rms_norm(delta, expected_residual, norm_weight, 1e-5))
    if silu:
        expected = ops.silu_mul(expected)
    got = bound.normed(delta, residual, norm_weight, 1e-5, silu)
    assert torch.equal(residual, expected_residual)
    assert torch.equal(got, expected)


def test_refusals(quant):
    blocks = table(Q8_0, 8, 64)
    with pytest.raises(ValueError, match="truncated or corrupt"):
        quant.bind(Q8_0, blocks[:, :-1].contiguous(), 64)
    with pytest.raises(ValueError, match="whole number"):
        quant.bind(Q4_K, table(Q8_0, 8, 64), 64)
    bound = quant.bind(Q8_0, blocks, 64)
    with pytest.raises(ValueError, match="bad input"):
        bound(torch.zeros(MAX_ROWS + 1, 64))
    with pytest.raises(ValueError, match="bad input"):
        bound(torch.zeros(1, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bias"):
        quant.bind(Q8_0, blocks, 64, torch.zeros(7))
    with pytest.raises(ValueError, match="blocks of 32"):
        quantize(torch.zeros(2, 40), Q8_0)
    with pytest.raises(ValueError, match="packs only"):
        quantize(torch.zeros(2, 256), Q4_K)


@SCALED_TYPES
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_k_types_linear_against_gguf_py(quant, qtype, dtype):
    """The few-row kernel and the unpacking of each K and IQ4 type against gguf-py's own dequantize
    (llama.cpp's formats, not this file's reading of them) times an input: random blocks,
    rows of 1 to 3 super-blocks, 1 and MAX_ROWS rows."""
    for super_blocks in (1, 3):
        k, n = 256 * super_blocks, 33
        blocks = table(qtype, n, k, seed=super_blocks + 70)
        kind = gguf.GGMLQuantizationType(qtype.ggml_id)
        weight = torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), kind).copy())
        assert torch.equal(quant.dequantize(qtype, blocks, k, dtype), weight.to(dtype))
        x = torch.randn(MAX_ROWS, k, generator=torch.Generator().manual_seed(k)).to(dtype)
        expected = F.linear(x.double(), weight.double())
        scale = (x.double().abs() @ weight.double().abs().T).max().item()
        for rows in (1, MAX_ROWS):
            got = quant.bind(qtype, blocks, k, None, dtype)(x[:rows]).double()
            # fp32 sums in another order; bf16 activations: one bf16 rounding of the result
            atol = 1e-5 * scale + 1e-6 if dtype is torch.float32 else 1e-2 * scale
            torch.testing.assert_close(got, expected[:rows], rtol=0, atol=atol)
