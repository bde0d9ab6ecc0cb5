"""oneDNN's matmuls run at a bounded set of row counts.

oneDNN builds a primitive for each input shape it meets, and torch keeps the last 1024 of them
(oneDNN's primitive cache and ideep's, each 1024 entries by default); for the default model's
layers one holds about 0.6 MiB. A prefill step's rows are its tokens, so an engine meets every
row count from 33 to ``max_num_batched_tokens``, and 4-5 layer shapes of each: the caches fill
and then churn. In a 40-minute soak of the default model that was the engine process's whole
growth: malloc'd memory in use rose by ~450 MiB, and what the caches evicted was left
fragmented in glibc's heap, so RSS rose further (25 MiB a minute at first, slowing).

Rows past ``EXACT_ROWS`` are padded with zero rows up to one of ``STEPS_PER_OCTAVE`` sizes in
each power of two (at most 1/8 more rows, whose results are dropped): 32 sizes up to 512 rows, 8
more for each doubling, so each layer shape has a few dozen primitives, built once. A padded
row costs its share of the matmul; the cache hits saved more than that (a prefill of every row
count from 33 to 512 ran faster padded, and its memory stayed flat).

A plain bf16 ``torch.mm`` goes to oneDNN too, with a primitive per shape in the same caches: the
quantized path's matmuls on unpacked weight tiles (worker/quantized.py) pad their rows alike.
Unpadded, the default model's four layer shapes at every row count from 33 to 1000 took 600
MiB of malloc'd memory and 930 MiB of RSS, and another pass 2.4 GiB more RSS (fragmentation).
"""

from __future__ import annotations

import torch

EXACT_ROWS = 32  # up to here every row count is its own shape: 32 shapes at most
STEPS_PER_OCTAVE = 8


def padded_rows(rows: int) -> int:
    """The row count oneDNN runs ``rows`` rows at: ``rows`` itself up to EXACT_ROWS, else the
    next multiple of an eighth of the power of two at or below it."""
    if rows <= EXACT_ROWS:
        return rows
    step = (1 << (rows.bit_length() - 1)) // STEPS_PER_OCTAVE
    return -(-rows // step) * step


def linear_pointwise(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``torch.ops.mkldnn._linear_pointwise(x, packed, bias)`` (x: [..., in_features]), its
    rows padded to ``padded_rows`` for oneDNN and the padding's results dropped."""
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    out = torch.ops.mkldnn._linear_pointwise(pad_rows(flat), packed, bias, "none", [], "")
    return out[:rows].view(*x.shape[:-1], out.shape[-1])


def pad_rows(flat: torch.Tensor) -> torch.Tensor:
    """``flat`` [rows, columns] followed by zero rows up to ``padded_rows(rows)`` (``flat``
    itself where that is ``rows``). A matmul's row is a dot product of that row alone, so the
    real rows' results are the unpadded call's (tests/worker/test_onednn_rows.py checks the bits
    on the quantized path's shapes)."""
    rows, columns = flat.shape
    padded = padded_rows(rows)
    if padded == rows:
        return flat
    grown = flat.new_empty((padded, columns))  # each byte written once
    grown[:rows] = flat
    grown[rows:] = 0
    return grown
