"""Random paged-cache cases shared by the Triton kernel tests."""

from __future__ import annotations

import pytest
import torch

from yaied.kernels.triton_common import interpreting

# Interpreter tests run CPU tensors through Triton's interpreter; on a GPU box without
# TRITON_INTERPRET they are skipped (the `cuda` tests cover the compiled kernels there).
interpreter_only = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1")

# fp32 products are exact in both; bf16: the kernels keep probabilities in fp32 longer than a
# bf16 reference would, so compare against an fp32 reference with bf16-sized tolerances.
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def make_cache(
    kv_heads: int,
    num_pages: int,
    page_size: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (kv_heads, num_pages, page_size, head_dim)
    return (
        torch.randn(shape, device=device).to(dtype),
        torch.randn(shape, device=device).to(dtype),
    )


def page_table(lengths: list[int], page_size: int, num_pages: int, device: str) -> torch.Tensor:
    """Distinct shuffled pages per row, as the page pool hands them out; padded with page 0."""
    widths = [-(-n // page_size) for n in lengths]
    width = max(max(widths), 1)
    order = torch.randperm(num_pages)[: sum(widths)].tolist()
    rows = []
    for w in widths:
        rows.append(order[:w] + [0] * (width - w))
        order = order[w:]
    return torch.tensor(rows, dtype=torch.int32, device=device)
