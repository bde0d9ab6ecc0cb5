"""bf16 linear layers with their weights pre-packed for oneDNN, the CPU's fast path.

A plain bf16 ``F.linear`` on CPU has oneDNN re-lay the weight into its blocked format on every
call; at decode batch sizes that costs as much as the matmul itself. Packing once at load time
made the 30 gate/up projections of the default model 1.5-1.9x faster for 1-32 rows and about 5%
faster at 512 (docs/benchmarks.md). fp32 models keep plain linears, so parity runs stay exact.

At one to four rows (a decode step of a few streams) a linear layer is a pass over its weight,
and oneDNN reaches about half the memory bandwidth there; the decode loop runs such steps through
the few-row kernel (yaied/kernels/cpu_gemv.c), which needs the plain weight too: a second copy of
every linear weight, kept only where it is small beside the machine's memory (``gemv_fits``).
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

from yaied.kernels.cpu_gemv import MAX_ROWS, CpuGemv

# The plain weights' second copy may take at most this share of physical memory.
GEMV_MEMORY_SHARE = 0.125

log = logging.getLogger(__name__)


class PackedLinear(nn.Module):
    """Drop-in for an nn.Linear whose weight is packed; inputs are [..., in_features]. With a
    few-row kernel, ``few_rows`` is that kernel bound to the plain weight, for the decode loop
    (worker/models/decode_loop.py); forward itself always runs oneDNN."""

    def __init__(self, linear: nn.Linear, batch_hint: int, gemv: CpuGemv | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
        self.bias = None if linear.bias is None else linear.bias.detach()
        # The few-row path: the plain weight (a second copy once the model's is dropped) and
        # the kernel bound to it.
        self.weight = weight.contiguous() if gemv is not None else None
        self.few_rows = None if gemv is None else gemv.bind(self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def gemv_fits(model: nn.Module) -> bool:
    """Whether a second copy of the model's linear weights (those not shared with another
    parameter, as a tied lm_head is) stays within GEMV_MEMORY_SHARE of physical memory."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    weights = {
        id(m.weight): m.weight
        for m in model.modules()
        if isinstance(m, nn.Linear) and id(m.weight) not in embeddings
    }
    extra = sum(w.numel() * w.element_size() for w in weights.values())
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return False
    return extra <= GEMV_MEMORY_SHARE * memory


def pack_linears(model: nn.Module, batch_hint: int, gemv: CpuGemv | None = None) -> int:
    """Replace every nn.Linear of a bf16 CPU model by a PackedLinear (using ``gemv`` for few
    rows when given); returns how many. Checks one layer against F.linear first and leaves the
    model alone if the packed path disagrees."""
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not linears:
        return 0
    try:
        _check_equal(linears[0][1], batch_hint, gemv)
    except (RuntimeError, AssertionError, ValueError) as exc:
        log.warning("packed bf16 linears unavailable (%s): using plain F.linear", exc)
        return 0
    for name, linear in linears:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, PackedLinear(linear, batch_hint, gemv))
    return len(linears)


def _check_equal(linear: nn.Linear, batch_hint: int, gemv: CpuGemv | None) -> None:
    with torch.inference_mode():
        packed = PackedLinear(linear, batch_hint, gemv)
        for rows in (1, 3, MAX_ROWS + 1):
            x = torch.randn(rows, linear.in_features, dtype=linear.weight.dtype)
            expected = F.linear(x, linear.weight, linear.bias).float()
            tolerance = 1e-2 * (expected.abs().max().item() + 1)
            got = [packed(x)] + ([packed.few_rows(x)] if gemv and rows <= MAX_ROWS else [])
            for out in got:
                assert (expected - out.float()).abs().max().item() <= tolerance, "disagrees"
