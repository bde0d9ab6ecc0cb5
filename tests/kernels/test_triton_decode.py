"""The Triton paged decode kernel against its torch reference: the interpreter on CPU with tiny
shapes, compiled on CUDA with the engine's shapes."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_cases import TOLERANCE, interpreter_only, make_cache, page_table
from yaied.kernels.triton_decode import (
    MAX_SPLITS,
    choose_num_splits,
    paged_decode_attention,
    paged_decode_reference,
)


def run_case(lengths, kv_heads, group, head_dim, page_size, dtype, num_splits, device="cpu"):
    torch.manual_seed(len(lengths) + group + num_splits)
    num_pages = sum(-(-n // page_size) for n in lengths) + 3
    k_cache, v_cache = make_cache(kv_heads, num_pages, page_size, head_dim, dtype, device)
    table = page_table(lengths, page_size, num_pages, device)
    lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    q = torch.randn(len(lengths), kv_heads * group, head_dim, device=device).to(dtype)
    scale = head_dim**-0.5
    ours = paged_decode_attention(q, k_cache, v_cache, table, lens, scale, num_splits)
    theirs = paged_decode_reference(q, k_cache, v_cache, table, lens, scale)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=tol, atol=tol)


@interpreter_only
@pytest.mark.parametrize(
    "dtype, group, num_splits",
    [(torch.float32, 3, 1), (torch.float32, 2, 3), (torch.bfloat16, 4, 2)],
)
def test_decode_matches_reference(dtype, group, num_splits):
    # Lengths cover: no keys (a padding row), one key, a page edge, several blocks per split.
    run_case([0, 1, 4, 5, 37], 2, group, 32, 4, dtype, num_splits)


@interpreter_only
def test_decode_checks_its_inputs():
    k_cache, v_cache = make_cache(2, 4, 4, 16, torch.float32)
    table = torch.zeros(1, 2, dtype=torch.int32)
    lens = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="do not group"):
        paged_decode_attention(torch.zeros(1, 3, 16), k_cache, v_cache, table, lens, 1.0)
    with pytest.raises(ValueError, match="int32 or int64"):
        paged_decode_attention(torch.zeros(1, 4, 16), k_cache, v_cache, table.float(), lens, 1.0)
    with pytest.raises(ValueError, match="dtype"):
        paged_decode_attention(
            torch.zeros(1, 4, 16, dtype=torch.bfloat16), k_cache, v_cache, table, lens, 1.0
        )
    with pytest.raises(ValueError, match="contiguous"):
        paged_decode_attention(torch.zeros(1, 4, 16), k_cache.mT, v_cache.mT, table, lens, 1.0)
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode_attention(
            torch.zeros(1, 4, 16), k_cache, v_cache, table, lens, 1.0, MAX_SPLITS + 1
        )


def test_num_splits_fill_the_device_for_small_batches():
    assert choose_num_splits(256, 8, 2048, num_sms=132) == 1  # 2048 programs already
    assert choose_num_splits(1, 8, 8192, num_sms=132) == MAX_SPLITS
    assert choose_num_splits(1, 8, 300, num_sms=132) == 2  # runs stay >= 256 tokens
    assert choose_num_splits(4, 8, 4096, num_sms=132) == 9
    with pytest.raises(ValueError):
        choose_num_splits(0, 8, 100, num_sms=132)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_splits", [1, 8])
def test_decode_matches_reference_on_cuda(dtype, num_splits):
    lengths = [1, 16, 17, 1000, 4097] + [int(n) for n in torch.randint(1, 2048, (27,))]
    # Qwen3-0.6B (group 2) and Llama-3.2-1B (group 4) shapes: 8 kv heads, head_dim 128 / 64.
    run_case(lengths, 8, 2, 128, 16, dtype, num_splits, device="cuda")
    run_case(lengths, 8, 4, 64, 16, dtype, num_splits, device="cuda")


@interpreter_only
def test_split_partials_stay_fp32_under_a_bf16_default_dtype():
    torch.set_default_dtype(torch.bfloat16)
    try:
        run_case([1, 40, 77], 2, 2, 16, 4, torch.float32, 4)
    finally:
        torch.set_default_dtype(torch.float32)
