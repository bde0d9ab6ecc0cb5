"""The Triton extend (prefill) kernel against its torch reference: fresh prompts, prefix-cache
hits and later chunks of a chunked prefill, packed into one varlen batch."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_cases import TOLERANCE, interpreter_only, make_cache, page_table
from yaied.kernels.triton_extend import extend_attention, extend_reference


def run_case(chunks, kv_heads, group, head_dim, page_size, dtype, device="cpu"):
    """chunks: (cached prefix length, new tokens) per sequence."""
    torch.manual_seed(len(chunks) + group)
    lengths = [prefix + new for prefix, new in chunks]
    num_pages = sum(-(-n // page_size) for n in lengths) + 2
    k_cache, v_cache = make_cache(kv_heads, num_pages, page_size, head_dim, dtype, device)
    table = page_table(lengths, page_size, num_pages, device)
    starts = [0]
    for _, new in chunks:
        starts.append(starts[-1] + new)
    q_starts = torch.tensor(starts, dtype=torch.int32, device=device)
    lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    q = torch.randn(starts[-1], kv_heads * group, head_dim, device=device).to(dtype)
    max_q_len = max(new for _, new in chunks)
    scale = head_dim**-0.5
    ours = extend_attention(q, k_cache, v_cache, table, q_starts, lens, max_q_len, scale)
    theirs = extend_reference(q, k_cache, v_cache, table, q_starts, lens, scale)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=tol, atol=tol)


@interpreter_only
@pytest.mark.parametrize("dtype, group", [(torch.float32, 2), (torch.bfloat16, 3)])
def test_extend_matches_reference(dtype, group):
    # fresh prompt longer than a block, prefix hit ending mid-page, one-token chunk, later chunk
    run_case([(0, 19), (6, 5), (9, 1), (20, 17)], 2, group, 16, 4, dtype)


@interpreter_only
def test_extend_checks_its_inputs():
    k_cache, v_cache = make_cache(1, 4, 4, 16, torch.float32)
    table = torch.zeros(1, 2, dtype=torch.int32)
    lens = torch.full((1,), 3, dtype=torch.int32)
    q = torch.zeros(3, 2, 16)
    with pytest.raises(ValueError, match="num_chunks \\+ 1"):
        extend_attention(q, k_cache, v_cache, table, lens, lens, 3, 1.0)
    with pytest.raises(ValueError, match="one row per chunk"):
        starts = torch.tensor([0, 3], dtype=torch.int32)
        extend_attention(q, k_cache, v_cache, table.repeat(2, 1), starts, lens, 3, 1.0)
    with pytest.raises(ValueError, match="head_dim|\\[tokens"):
        starts = torch.tensor([0, 3], dtype=torch.int32)
        extend_attention(torch.zeros(3, 2, 8), k_cache, v_cache, table, starts, lens, 3, 1.0)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_extend_matches_reference_on_cuda(dtype):
    chunks = [(0, 1024), (512, 300), (1000, 1), (37, 64), (2048, 513)]
    run_case(chunks, 8, 2, 128, 16, dtype, device="cuda")  # Qwen3-0.6B
    run_case(chunks, 8, 4, 64, 16, dtype, device="cuda")  # Llama-3.2-1B
