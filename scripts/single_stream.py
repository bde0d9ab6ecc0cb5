"""W-single for bench_offline.py: one request alone, a 512-token random prompt, 256 greedy
output tokens (ignore_eos), against transformers' batch-1 ``generate`` and the memory floor.

TTFT is the best of a few 1-token generations of fresh 512-token prompts (a fresh prompt each
time, so the prefix cache serves none of them); decode tok/s is the 255 tokens after the first
over the full request's time less that TTFT. transformers is timed the same way.

The memory floor: at batch 1 a decode step reads every weight once (the lm_head included, even
when tied to the embedding) plus the K/V of its context, so floor tok/s = copy bandwidth /
(weight bytes + KV bytes per token x the mean context of the decode). Weight bytes are those the
decode path reads: bf16 linear weights under dtype auto on every CPU, fp32 math or not; the KV
cache is in the math dtype. The bandwidth is measured
here, a 1 GiB ``copy_`` counted as read + write traffic (2 GiB moved), best of 5, right before
and right after the decode (``floor_bandwidth_gb_s``); the floor divides by their mean.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import torch

PROMPT_TOKENS, OUTPUT_TOKENS, TTFT_REPEATS = 512, 256, 3


def copy_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes per second moved (read + write) by the best of `repeats` copies of `gib` GiB."""
    src = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - started)
    return 2 * src.numel() * 4 / best


def kv_bytes_per_token(hf_config: Any, dtype: torch.dtype) -> int:
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    element = torch.tensor([], dtype=dtype).element_size()
    return 2 * hf_config.num_hidden_layers * kv_heads * head_dim * element


def _engine_seconds(llm: Any, prompt: list[int], max_tokens: int) -> float:
    from yaied import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    (out,) = llm.generate([prompt], params)
    elapsed = time.perf_counter() - started
    if len(out.token_ids) != max_tokens:
        raise RuntimeError(f"generated {len(out.token_ids)} of {max_tokens} tokens: {out.error}")
    return elapsed


def decode_weight_bytes(llm: Any, weight_params: int, weight_dtype: torch.dtype) -> int:
    """The bytes of the weights a decode step reads: quantized projections by their block
    tables (model.quantization), the rest at ``weight_dtype``."""
    from yaied.worker.quantized import QuantizedLinear

    model = llm.engine.worker.loaded.model
    quantized = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    blocks = sum(m.blocks.numel() for m in quantized)
    rest = weight_params - sum(m.in_features * m.out_features for m in quantized)
    return blocks + rest * torch.tensor([], dtype=weight_dtype).element_size()


def single_stream_record(
    llm: Any,
    hf_model: Any,
    prompt: list[int],
    seed: int,
    weight_params: int,
    dtypes: tuple[torch.dtype, torch.dtype],
    device: torch.device,
    on_reference_thread: Callable[..., Any] = lambda fn, *args: fn(*args),
) -> dict[str, Any]:
    """One W-single run: `prompt` is the workload's request; fresh prompts time the TTFT;
    `dtypes`: the engine's (linear weights, KV cache) dtypes.
    `on_reference_thread(fn, *args)` runs the copy and transformers away from the thread that
    drives the engine (see bench_offline.py's main)."""
    rng = random.Random(1000 + seed)

    def fresh() -> list[int]:
        return [rng.randrange(llm.vocab_size) for _ in range(PROMPT_TOKENS)]

    ttft = min(_engine_seconds(llm, fresh(), 1) for _ in range(TTFT_REPEATS))
    # The copy right before and right after the decode, the floor from their mean: this
    # machine's bandwidth can move by half within a minute, and a copy timed at another moment
    # than the decode gave floor shares of 0.55 and 0.83 for the same run.
    bandwidth_before = on_reference_thread(copy_bandwidth)
    total = _engine_seconds(llm, prompt, OUTPUT_TOKENS)
    bandwidth_after = on_reference_thread(copy_bandwidth)
    bandwidth = (bandwidth_before + bandwidth_after) / 2
    decode_tok_s = (OUTPUT_TOKENS - 1) / (total - ttft)
    weight_dtype, kv_dtype = dtypes
    weight_bytes = decode_weight_bytes(llm, weight_params, weight_dtype)
    kv_per_token = kv_bytes_per_token(llm.hf_config, kv_dtype)
    mean_context = PROMPT_TOKENS + OUTPUT_TOKENS / 2
    floor_tok_s = bandwidth / (weight_bytes + kv_per_token * mean_context)
    record: dict[str, Any] = {
        "prompt_tokens": PROMPT_TOKENS,
        "output_tokens": OUTPUT_TOKENS,
        "elapsed_s": round(total, 3),
        "ttft_ms": round(ttft * 1e3, 1),
        "decode_tok_s": round(decode_tok_s, 2),
        "output_tok_s": round(OUTPUT_TOKENS / total, 2),
        "weight_bytes": weight_bytes,
        "kv_bytes_per_token": kv_per_token,
        # not copy_bandwidth_gb_s: bench_offline's machine record (at start-up) has that name
        "floor_bandwidth_gb_s": [round(bandwidth_before / 1e9, 1), round(bandwidth_after / 1e9, 1)],
        "memory_floor_tok_s": round(floor_tok_s, 1),
        "floor_share": round(decode_tok_s / floor_tok_s, 3),
    }
    if hf_model is not None:
        from hf_baseline import hf_generate

        hf_ttft = min(
            on_reference_thread(hf_generate, hf_model, [fresh()], 1, device)
            for _ in range(TTFT_REPEATS)
        )
        hf_total = on_reference_thread(hf_generate, hf_model, [prompt], OUTPUT_TOKENS, device)
        hf_decode = (OUTPUT_TOKENS - 1) / (hf_total - hf_ttft)
        record.update(
            hf_ttft_ms=round(hf_ttft * 1e3, 1),
            hf_decode_tok_s=round(hf_decode, 2),
            hf_output_tok_s=round(OUTPUT_TOKENS / hf_total, 2),
            ratio=round(decode_tok_s / hf_decode, 3),
        )
    return record
