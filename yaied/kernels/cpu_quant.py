"""Block-quantized weights (GGUF's Q8_0, Q4_0, Q4_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL,
IQ4_XS): their formats, a torch reference (unpacking all ten, packing Q8_0 and Q4_0 from float
weights), and the launcher of cpu_quant.c, whose few-row linear reads the blocks directly and
whose unpacking feeds matmuls of many rows.

A weight is its block table: a contiguous uint8 tensor [N, row bytes], each row K / block size
blocks of ``QuantType.block_bytes`` (the layout GGUF files store, so a file's tensor is used as
it is; Q4_0 and Q4_1 are regrouped at load into ``Q4_0_GROUPED`` and ``Q4_1_GROUPED``, the same
blocks with each 16 blocks' scales together, which the kernels read faster). The C side takes a
descriptor (type, address of the table) where cpu_gemv.c takes a bf16 weight, with the same entry
signature, so the decode loop (cpu_decode_loop.c) calls either.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import NamedTuple

import torch

from yaied.kernels.cpu_build import KernelLibrary, load_library
from yaied.kernels.cpu_gemv import BoundLinear, slice_limit

SOURCE = Path(__file__).with_name("cpu_quant.c")
MAX_ROWS = 8  # as in cpu_quant.c
# A quantized LM head under fp32 math takes the kernel in slices of MAX_ROWS up to this many
# rows, from avx2 up; past that, unpacking the weight for a matmul is the faster (a Q8_0 head
# of the default model's shape on a Zen 4: 9 rows 8.2-12.5 against 25-34 ms, 16 rows 22.5
# against 30, 32 rows even at avx2 and slower at avx512). The generic body is slower already
# at 9 rows.
SLICED_MAX_ROWS = 16


class QuantType(NamedTuple):
    name: str
    ggml_id: int  # GGUF's tensor type number
    block_size: int  # weights a block
    block_bytes: int


Q8_0 = QuantType("q8_0", 8, 32, 34)
Q4_0 = QuantType("q4_0", 2, 32, 18)
Q4_1 = QuantType("q4_1", 3, 32, 20)
Q2_K = QuantType("q2_k", 10, 256, 84)
Q3_K = QuantType("q3_k", 11, 256, 110)
Q4_K = QuantType("q4_k", 12, 256, 144)
Q5_K = QuantType("q5_k", 13, 256, 176)
Q6_K = QuantType("q6_k", 14, 256, 210)
IQ4_NL = QuantType("iq4_nl", 20, 32, 18)
IQ4_XS = QuantType("iq4_xs", 23, 256, 136)
QUANT_TYPES = {t.name: t for t in (Q8_0, Q4_0, Q4_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS)}
# The 16 values a 4-bit index of IQ4_NL and IQ4_XS picks (llama.cpp's kvalues_iq4nl)
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# yaied's own layouts of Q4_0 and Q4_1 (cpu_quant.c's header): a row's blocks in groups of
# SCALE_GROUP (the last may be shorter), each group's fp16 d first, then (Q4_1) its fp16 m, then
# its blocks' 16 bytes of quants. Not GGUF types: their numbers are cpu_quant.c's, and they show
# as "q4_0" and "q4_1".
Q4_0_GROUPED = QuantType("q4_0", 1002, 32, 18)
Q4_1_GROUPED = QuantType("q4_1", 1003, 32, 20)
SCALE_GROUP = 16
# GGUF's type -> its grouped layout, and back
GROUPED = {Q4_0: Q4_0_GROUPED, Q4_1: Q4_1_GROUPED}
UNGROUPED = {grouped: gguf for gguf, grouped in GROUPED.items()}
BY_GGML_ID = {t.ggml_id: t for t in QUANT_TYPES.values()}
# The types yaied packs from float weights itself (--quantization q8_0 | q4_0).
PACKABLE = (Q8_0, Q4_0)
# cpu_quant.c's descriptor of a weight stacked from parts of different types (BoundQuantLinear)
STACKED = 2000


def row_bytes(qtype: QuantType, k: int) -> int:
    return k // qtype.block_size * qtype.block_bytes


def check_table(qtype: QuantType, blocks: torch.Tensor, n: int, k: int, name: str) -> None:
    """ValueError naming the tensor unless blocks is a contiguous uint8 [n, row bytes] table of
    whole blocks for a [n, k] weight."""
    if k % qtype.block_size:
        raise ValueError(
            f"{name}: {k} columns are not a whole number of {qtype.name} blocks "
            f"({qtype.block_size} weights each)"
        )
    want = (n, row_bytes(qtype, k))
    if blocks.dtype != torch.uint8 or tuple(blocks.shape) != want or not blocks.is_contiguous():
        raise ValueError(
            f"{name}: the {qtype.name} block table is {tuple(blocks.shape)} {blocks.dtype}, "
            f"a [{n}, {k}] weight needs contiguous uint8 {want}: truncated or corrupt"
        )


def group_blocks(qtype: QuantType, blocks: torch.Tensor) -> tuple[QuantType, torch.Tensor]:
    """A Q4_0 or Q4_1 table [N, row bytes] in GGUF's layout, regrouped: (its grouped type, a new
    tensor)."""
    return GROUPED[qtype], _regroup(qtype, blocks, to_grouped=True)


def ungroup_blocks(grouped: QuantType, blocks: torch.Tensor) -> tuple[QuantType, torch.Tensor]:
    """A grouped table back in GGUF's layout: (GGUF's type, a new tensor)."""
    qtype = UNGROUPED[grouped]
    return qtype, _regroup(qtype, blocks, to_grouped=False)


def _regroup(qtype: QuantType, blocks: torch.Tensor, to_grouped: bool) -> torch.Tensor:
    """Copied group by group into one new table: no other copy of the weight on the way (a 1B
    model's Q4_0 is 600 MB)."""
    n, size_of = blocks.shape[0], qtype.block_bytes
    head = size_of - 16  # d, and Q4_1's m: 2 bytes each
    count = blocks.shape[1] // size_of
    out = torch.empty_like(blocks)
    for first in range(0, count, SCALE_GROUP):
        size = min(SCALE_GROUP, count - first)
        columns = slice(first * size_of, (first + size) * size_of)
        # the same group of blocks in the two layouts, one of them being written
        source, target = blocks[:, columns], out[:, columns]
        gguf, grouped = (source, target) if to_grouped else (target, source)
        gguf = gguf.view(n, size, size_of)
        # each 2-byte field of the blocks' heads (d, m), then the quants
        fields = [
            (gguf[..., at : at + 2], grouped[:, at * size : (at + 2) * size].view(n, size, 2))
            for at in range(0, head, 2)
        ]
        fields.append((gguf[..., head:], grouped[:, head * size :].view(n, size, 16)))
        for in_gguf, in_grouped in fields:
            if to_grouped:
                in_grouped.copy_(in_gguf)
            else:
                in_gguf.copy_(in_grouped)
    return out


# ---- the torch reference ----


def _halves(table: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 at byte ``offset`` of every block, as fp32: table [..., blocks, bytes]."""
    return table[..., offset : offset + 2].contiguous().view(torch.float16).float()


def dequantize_reference(qtype: QuantType, blocks: torch.Tensor, k: int) -> torch.Tensor:
    """The weight [N, k] fp32 that a block table holds (the formats as cpu_quant.c states them)."""
    if qtype in UNGROUPED:
        return dequantize_reference(*ungroup_blocks(qtype, blocks), k)
    n = blocks.shape[0]
    table = blocks.reshape(n, k // qtype.block_size, qtype.block_bytes)
    d = _halves(table, 0)
    if qtype is Q8_0:
        return (table[..., 2:].view(torch.int8).float() * d).reshape(n, k)
    if qtype in (Q4_0, Q4_1):
        data = table[..., 4:] if qtype is Q4_1 else table[..., 2:]
        q = torch.cat([data & 0xF, data >> 4], dim=-1).float()
        m = _halves(table, 2) if qtype is Q4_1 else -8.0 * d
        return (q * d + m).reshape(n, k)
    if qtype is Q6_K:
        return _q6_k_reference(table, n, k)
    if qtype is Q3_K:
        return _q3_k_reference(table, n, k)
    if qtype is Q2_K:
        return _q2_k_reference(table, n, k)
    if qtype in (IQ4_NL, IQ4_XS):
        return _iq4_reference(qtype, table, n, k)
    # Q4_K, and Q5_K: the same with 32 bytes of fifth bits (bit j of byte i: sub-block j's
    # weight i) before the nibbles
    dmin = _halves(table, 2)
    s = table[..., 4:16].long()
    low = torch.cat([s[..., 0:4] & 63, s[..., 8:12] & 0xF | (s[..., 0:4] >> 6) << 4], dim=-1)
    mins = torch.cat([s[..., 4:8] & 63, s[..., 8:12] >> 4 | (s[..., 4:8] >> 6) << 4], dim=-1)
    data = table[..., 48:] if qtype is Q5_K else table[..., 16:]
    data = data.reshape(n, -1, 4, 32)
    q = torch.stack([data & 0xF, data >> 4], dim=3).reshape(n, -1, 8, 32)
    if qtype is Q5_K:
        qh = table[..., 16:48].reshape(n, -1, 1, 32)
        q = q | torch.cat([(qh >> bit & 1) << 4 for bit in range(8)], dim=2)
    weights = q.float() * (d * low.float())[..., None] - (dmin * mins.float())[..., None]
    return weights.reshape(n, k)


def _q6_k_reference(table: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Q6_K (table [n, super-blocks, 210]): each 128 weights' 64 bytes of low nibbles (the
    first 32 bytes' low nibbles, the next 32's, then their high nibbles) and 32 bytes of high
    pairs (bits 0-1, 2-3, 4-5, 6-7 of byte i for weights i, 32 + i, 64 + i, 96 + i)."""
    ql = table[..., :128].reshape(n, -1, 2, 1, 64)
    low = torch.cat([ql & 0xF, ql >> 4], dim=3).reshape(n, -1, 2, 4, 32)
    qh = table[..., 128:192].reshape(n, -1, 2, 1, 32)
    high = torch.cat([(qh >> shift) & 3 for shift in (0, 2, 4, 6)], dim=3)
    q = (low | high << 4).float() - 32.0
    scales = table[..., 192:208].contiguous().view(torch.int8).float() * _halves(table, 208)
    return (q.reshape(n, -1, 16, 16) * scales[..., None]).reshape(n, k)


def _q3_k_reference(table: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Q3_K (table [n, super-blocks, 110]): 32 bytes of high bits (bit 4 h + j of byte i for
    weight 128 h + 32 j + i), 64 of low pairs (bits 2 j, 2 j + 1 of byte 32 h + i for the same
    weight), 12 of sixteen 6-bit scales (scale s: the low nibble of byte s for s < 8, else the
    high nibble of byte s - 8, and bits 2 (s // 4), + 1 of byte 8 + s % 4 on top), fp16 d last.
    q = low + 4 high - 4, w = d (scale - 32) q."""
    low = table[..., 32:96].reshape(n, -1, 2, 1, 32) >> torch.tensor([0, 2, 4, 6])[:, None] & 3
    high = table[..., :32].reshape(n, -1, 1, 32) >> torch.arange(8)[:, None] & 1
    q = (low.reshape(n, -1, 8, 32) | high << 2).float() - 4.0
    s = table[..., 96:108].long()
    nibbles = torch.cat([s[..., :8] & 0xF, s[..., :8] >> 4], dim=-1)
    tops = torch.cat([s[..., 8:12] >> shift & 3 for shift in (0, 2, 4, 6)], dim=-1)
    scales = ((nibbles | tops << 4) - 32).float() * _halves(table, 108)
    return (q.reshape(n, -1, 16, 16) * scales[..., None]).reshape(n, k)


def _q2_k_reference(table: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Q2_K (table [n, super-blocks, 84]): 16 bytes of 4-bit scales (low nibble) and mins (high),
    64 of quants laid out as Q3_K's low pairs, fp16 d and dmin last: w = d sc_s q - dmin m_s."""
    q = table[..., 16:80].reshape(n, -1, 2, 1, 32) >> torch.tensor([0, 2, 4, 6])[:, None] & 3
    sc = table[..., :16]
    scales, mins = (sc & 0xF).float() * _halves(table, 80), (sc >> 4).float() * _halves(table, 82)
    weights = q.reshape(n, -1, 16, 16).float() * scales[..., None] - mins[..., None]
    return weights.reshape(n, k)


def _iq4_reference(qtype: QuantType, table: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """IQ4_NL (table [n, blocks, 18]: fp16 d, 16 bytes of 4-bit indices laid out as Q4_0's
    quants) and IQ4_XS ([n, super-blocks, 136]: fp16 d, a 16-bit word of the eight 6-bit scales'
    top pairs, 4 bytes of their low nibbles, then 8 runs of 16 bytes as IQ4_NL's):
    w = d v[q], or d (scale_j - 32) v[q] (v: IQ4_VALUES)."""
    data = table[..., 2:] if qtype is IQ4_NL else table[..., 8:]
    data = data.reshape(n, -1, 16).long()
    values = torch.tensor(IQ4_VALUES, dtype=torch.float32)[torch.cat([data & 0xF, data >> 4], -1)]
    scale = _halves(table, 0)
    if qtype is IQ4_XS:
        high = table[..., 2].long() | table[..., 3].long() << 8
        low = table[..., 4:8].long()
        low = torch.stack([low & 0xF, low >> 4], dim=-1).reshape(n, -1, 8)
        tops = high[..., None] >> torch.arange(0, 16, 2) & 3
        scale = (scale * ((low | tops << 4) - 32).float()).reshape(n, -1)
    else:
        scale = scale.reshape(n, -1)
    return (values * scale[..., None]).reshape(n, k)


def quantize(weight: torch.Tensor, qtype: QuantType) -> torch.Tensor:
    """A float weight [N, K] (K a multiple of 32) packed into a Q8_0 or Q4_0 block table.
    Q8_0: scale = max |w| / 127 a block, q = round(w / scale). Q4_0: the block's value of
    largest magnitude maps to -8 (so its sign picks the scale's), q = round(w / scale) + 8
    clamped to [0, 15]. Scales are stored in fp16 and q computed with the stored scale."""
    if qtype not in PACKABLE:
        raise ValueError(f"yaied packs only {', '.join(t.name for t in PACKABLE)}")
    n, k = weight.shape
    if k % 32:
        raise ValueError(f"{k} columns are not a whole number of blocks of 32")
    w = weight.detach().float().reshape(n, k // 32, 32)
    if qtype is Q8_0:
        scale = (w.abs().amax(dim=-1, keepdim=True) / 127).half()
        inv = torch.where(scale == 0, 0.0, 1.0 / scale.float())
        q = (w * inv).round().clamp(-127, 127).to(torch.int8).view(torch.uint8)
        return torch.cat([scale.view(torch.uint8), q], dim=-1).reshape(n, -1).contiguous()
    index = w.abs().argmax(dim=-1, keepdim=True)
    scale = (w.gather(-1, index) / -8).half()
    inv = torch.where(scale == 0, 0.0, 1.0 / scale.float())
    q = ((w * inv).round() + 8).clamp(0, 15).to(torch.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)
    return torch.cat([scale.view(torch.uint8), packed], dim=-1).reshape(n, -1).contiguous()


# ---- the launcher ----

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}


class CpuQuant:
    """The compiled kernels at one ISA level; ``CpuQuant.load()`` returns None where they
    cannot be built."""

    def __init__(self, library: KernelLibrary) -> None:
        self.level = library.level
        self._linear, self._unpack = {}, {}
        for dtype, suffix in _SUFFIX.items():
            function = getattr(library.cdll, f"few_rows_qlinear_{suffix}")
            function.argtypes = [_P, _P, _P, _F] + [_P] * 4 + [_I] * 5
            function.restype = ctypes.c_int
            self._linear[dtype] = function
            unpack = getattr(library.cdll, f"dequantize_{suffix}")
            unpack.argtypes = [_I, _P, _P, _I, _I, _I]
            unpack.restype = ctypes.c_int
            self._unpack[dtype] = unpack

    def sliced_max_rows(self, dtype: torch.dtype) -> int:
        """Up to how many rows of ``dtype`` activations a quantized LM head takes the kernel
        (in slices): under bf16 math oneDNN's matmul on the unpacked weight is the faster past
        MAX_ROWS (AVX512-BF16, 16 rows: 11.0 against 18.2 ms)."""
        return slice_limit(self.level, dtype, SLICED_MAX_ROWS)

    @classmethod
    def load(
        cls, level: str | None = None, cache_dir: Path | None = None, *, strict: bool = False
    ) -> CpuQuant | None:
        library = load_library(SOURCE, level, cache_dir, strict=strict)
        return None if library is None else cls(library)

    def bind(
        self,
        qtype: QuantType,
        blocks: torch.Tensor,
        k: int,
        bias: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> BoundQuantLinear:
        """The few-row kernel for one layer: blocks the [N, row bytes] table of a [N, k]
        weight, bias [N] in the activations' ``dtype`` or None. The caller keeps blocks and
        bias alive for as long as it uses the result."""
        return self.bind_parts([(qtype, blocks)], k, bias, dtype)

    def bind_parts(
        self,
        parts: list[tuple[QuantType, torch.Tensor]],
        k: int,
        bias: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> BoundQuantLinear:
        """``bind`` for a weight whose rows are ``parts`` (type, table) in order, of any types:
        a merged projection such as q/k/v with V in another type."""
        return BoundQuantLinear(self._linear[dtype], dtype, parts, k, bias)

    def dequantize(
        self,
        qtype: QuantType,
        blocks: torch.Tensor,
        k: int,
        dtype: torch.dtype = torch.float32,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The weight [N, k] in ``dtype`` (fp32 or bf16), written into ``out`` when given
        (a reused buffer of at least N * k elements of ``dtype``)."""
        n = blocks.shape[0]
        check_table(qtype, blocks, n, k, "weight")
        if out is None:
            out = torch.empty((n, k), dtype=dtype)
        else:
            if out.dtype != dtype or out.numel() < n * k or not out.is_contiguous():
                raise ValueError("bad buffer for the unpacked weight")
            out = out.view(-1)[: n * k].view(n, k)
        status = self._unpack[dtype](
            qtype.ggml_id, blocks.data_ptr(), out.data_ptr(), n, k, torch.get_num_threads()
        )
        if status != 0:
            raise RuntimeError(f"unpacking {qtype.name} failed (status {status})")
        return out


class BoundQuantLinear(BoundLinear):
    """One quantized layer's few-row kernel: BoundLinear (cpu_gemv.py) with block tables for
    its weight; ``descriptor`` is the int64 tensor the C side takes as the weight: (type, table
    address), or for parts of different types (STACKED, count, then each part's type, table
    address and rows)."""

    __slots__ = ("descriptor", "_blocks")

    def __init__(
        self,
        function,
        dtype: torch.dtype,
        parts: list[tuple[QuantType, torch.Tensor]],
        k: int,
        bias: torch.Tensor | None,
    ) -> None:
        for qtype, blocks in parts:
            check_table(qtype, blocks, blocks.shape[0], k, "weight")
        n = sum(blocks.shape[0] for _, blocks in parts)
        if len(parts) == 1:
            fields = [parts[0][0].ggml_id, parts[0][1].data_ptr()]
        else:
            fields = [STACKED, len(parts)]
            for qtype, blocks in parts:
                fields += [qtype.ggml_id, blocks.data_ptr(), blocks.shape[0]]
        self.descriptor = torch.tensor(fields, dtype=torch.int64)
        self.kernel_weight = self.descriptor
        self._blocks = [blocks for _, blocks in parts]  # alive with the descriptor's addresses
        self._bind(function, dtype, self.descriptor.data_ptr(), n, k, bias)

    @staticmethod
    def _check(status: int) -> None:
        _check(status)


def _check(status: int) -> None:
    if status == -2:
        raise MemoryError("the quantized linear kernel could not get scratch memory")
    if status != 0:
        raise RuntimeError(f"the quantized linear kernel failed (status {status})")
