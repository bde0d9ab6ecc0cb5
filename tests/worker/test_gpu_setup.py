"""The GPU path's start-up arithmetic, on CPU: backend choice, the warm-up step, KV sizing."""

from __future__ import annotations

import pytest

from yaied.worker.gpu_setup import kv_cache_bytes, resolve_attention_backend, warmup_seqs

GIB = 2**30


def test_auto_backend_is_triton_on_cuda_and_torch_on_cpu(monkeypatch):
    assert resolve_attention_backend("auto", "cuda") == "triton"
    assert resolve_attention_backend("auto", "cpu") == "torch"
    assert resolve_attention_backend("torch", "cuda") == "torch"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        resolve_attention_backend("triton", "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_attention_backend("triton", "cpu") == "triton"
    with pytest.raises(ValueError, match="auto, triton or torch"):
        resolve_attention_backend("flash", "cuda")


def test_models_run_through_transformers_stay_on_the_torch_path():
    # Their attention writes K/V itself (int64 slots) and their forward syncs on the host.
    assert resolve_attention_backend("auto", "cuda", native=False) == "torch"
    assert resolve_attention_backend("torch", "cuda", native=False) == "torch"
    with pytest.raises(ValueError, match="native models only"):
        resolve_attention_backend("triton", "cuda", native=False)


@pytest.mark.parametrize("max_tokens, max_seqs", [(8192, 256), (512, 64), (4, 16), (1, 1)])
def test_warmup_step_is_as_large_as_the_scheduler_allows(max_tokens, max_seqs):
    seqs, num_pages = warmup_seqs(max_tokens, max_seqs, page_size=16)
    assert sum(len(s.token_ids) for s in seqs) == max_tokens
    assert len(seqs) == min(max_seqs, max_tokens)
    assert all(s.sample for s in seqs)
    pages = [p for s in seqs for p in s.page_ids]
    assert sorted(pages) == list(range(num_pages))  # distinct pages, no gaps
    for seq in seqs:
        assert len(seq.page_ids) * 16 >= seq.start_pos + len(seq.token_ids)


def test_kv_budget_is_the_utilised_share_less_everything_else():
    budget = kv_cache_bytes(
        total=80 * GIB,
        free=70 * GIB,
        torch_reserved=8 * GIB,  # so 2 GiB belong to the CUDA context and other processes
        torch_peak=5 * GIB,
        utilization=0.9,
        graph_reserve=GIB,
    )
    assert budget == int(80 * GIB * 0.9) - 2 * GIB - 5 * GIB - GIB


def test_kv_budget_refuses_when_nothing_is_left():
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_cache_bytes(
            total=8 * GIB, free=GIB, torch_reserved=0, torch_peak=2 * GIB, utilization=0.5
        )


def test_a_bare_cuda_device_gets_the_current_index(monkeypatch):
    # torch.cuda.set_device refuses torch.device("cuda"): the worker's device always has an index.
    import torch

    from yaied.worker.worker import pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert pick_device("cuda") == torch.device("cuda", 0)
    assert pick_device("auto") == torch.device("cuda", 0)
    assert pick_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="2 CUDA device"):
        pick_device("cuda:2")
    assert pick_device("cpu") == torch.device("cpu")
