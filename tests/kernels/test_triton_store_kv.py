"""The Triton K/V store against its torch reference, padding slots included."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_cases import interpreter_only, make_cache
from yaied.kernels.triton_store_kv import store_kv, store_kv_reference


def run_case(num_tokens, kv_heads, head_dim, page_size, num_pages, dtype, device="cpu"):
    torch.manual_seed(num_tokens)
    k_cache, v_cache = make_cache(kv_heads, num_pages, page_size, head_dim, dtype, device)
    slots = torch.randperm(num_pages * page_size, device=device)[:num_tokens]
    slots[::3] = -1  # padding rows write nothing
    # k and v as views into a fused qkv row, as the model hands them over
    qkv = torch.randn(num_tokens, 3 * kv_heads * head_dim, device=device).to(dtype)
    k = qkv[:, kv_heads * head_dim : 2 * kv_heads * head_dim].view(num_tokens, kv_heads, -1)
    v = qkv[:, 2 * kv_heads * head_dim :].view(num_tokens, kv_heads, -1)
    ours = (k_cache.clone(), v_cache.clone())
    theirs = (k_cache.clone(), v_cache.clone())
    store_kv(k, v, *ours, slots)
    store_kv_reference(k, v, *theirs, slots)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    assert not torch.equal(ours[0], k_cache)  # something was written


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_matches_reference(dtype):
    run_case(7, 3, 24, 4, 5, dtype)


@interpreter_only
def test_store_checks_its_inputs():
    k_cache, v_cache = make_cache(2, 4, 4, 16, torch.float32)
    k = torch.zeros(3, 2, 16)
    with pytest.raises(ValueError, match="one slot per token"):
        store_kv(k, k, k_cache, v_cache, torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="dtype"):
        store_kv(k.bfloat16(), k.bfloat16(), k_cache, v_cache, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="cache rows"):
        store_kv(torch.zeros(3, 1, 16), torch.zeros(3, 1, 16), k_cache, v_cache,
                 torch.zeros(3, dtype=torch.int64))  # fmt: skip


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_store_matches_reference_on_cuda(dtype):
    run_case(4096, 8, 128, 16, 1024, dtype, device="cuda")
