"""Batch-1 decode-step timing for bench_offline.py (``--decode-step``): the measured step time
next to the memory floor, the time to read every weight once at the device's spec bandwidth.

A decode step at batch 1 reads each weight once (the lm_head included, even when tied to the
embedding) and does little else, so weight bytes / bandwidth bounds it from below.
"""

from __future__ import annotations

import random
import time
from typing import Any

import torch

# Spec HBM bandwidth in bytes/s by a substring of the device name (most specific first).
SPEC_BANDWIDTH = (("H200", 4.8e12), ("H100", 3.35e12))


def spec_bandwidth(device_name: str) -> float | None:
    """The device's spec memory bandwidth, or None for a device not in the table."""
    return next((bw for key, bw in SPEC_BANDWIDTH if key in device_name.upper()), None)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _timed_generate(llm: Any, prompt: list[int], max_tokens: int) -> float:
    from yaied import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    out = llm.generate([prompt], params)[0]
    elapsed = time.perf_counter() - started
    if len(out.token_ids) != max_tokens:
        raise RuntimeError(f"generated {len(out.token_ids)} of {max_tokens} tokens: {out.error}")
    return elapsed


def time_decode_step(
    llm: Any, vocab_size: int, *, prompt_len: int = 128, steps: int = 128, repeats: int = 3
) -> float:
    """Seconds per decode step at batch 1, host work included: (time for steps + 1 tokens -
    time for 1 token) / steps, each the best of `repeats`, every run on a fresh random prompt
    (no prefix-cache hit makes one run's prefill cheaper than another's)."""
    rng = random.Random(0)

    def prompt() -> list[int]:
        return [rng.randrange(vocab_size) for _ in range(prompt_len)]

    _timed_generate(llm, prompt(), steps + 1)  # warm-up
    prefill = min(_timed_generate(llm, prompt(), 1) for _ in range(repeats))
    full = min(_timed_generate(llm, prompt(), steps + 1) for _ in range(repeats))
    return max(full - prefill, 0.0) / steps


def decode_step_record(
    llm: Any, model: str, weight_params: int, dtype: torch.dtype, device: torch.device, steps: int
) -> dict[str, Any]:
    name = device_name(device)
    weight_bytes = weight_params * torch.tensor([], dtype=dtype).element_size()
    step = time_decode_step(llm, llm.vocab_size, steps=steps)
    bandwidth = spec_bandwidth(name)
    record: dict[str, Any] = {
        "mode": "decode-step",
        "model": model,
        "device": name,
        "dtype": str(dtype).removeprefix("torch."),
        "batch_size": 1,
        "decode_steps": steps,
        "weight_bytes": weight_bytes,
        "step_ms": round(step * 1e3, 4),
    }
    if bandwidth is not None:
        floor = weight_bytes / bandwidth
        record["spec_bandwidth_tb_s"] = bandwidth / 1e12
        record["memory_floor_ms"] = round(floor * 1e3, 4)
        record["step_over_floor"] = round(step / floor, 3)
    return record
