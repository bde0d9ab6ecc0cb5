"""The transformers baseline of bench_offline.py and bench_serving.py (``--compare-hf``): the same
prompts through ``generate`` in one left-padded greedy batch (W-nano: batches of 64), in
transformers' fastest dtype on this machine (``--hf-dtype fastest``: bf16 and fp32 each time a
probe of the workload, and the faster runs it; on a CPU without bf16 dot products bf16 matmuls
run at a tenth of fp32's speed, on one with them at twice or more)."""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

HF_NANO_BATCH = 64
HF_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
PROBE_PROMPTS, PROBE_TOKENS = 4, 8


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def load_hf_model(
    args: argparse.Namespace, llm: Any, dtype: torch.dtype, device: torch.device
) -> Any:
    import transformers
    from transformers import AutoModelForCausalLM

    # transformers renamed torch_dtype to dtype in 4.56.
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    dtype_kw = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    if args.load_format == "dummy":  # random weights, as the engine's: fine for throughput
        model = AutoModelForCausalLM.from_config(llm.hf_config, **{dtype_kw: dtype})
    else:
        from yaied.worker.model_files import resolve_model_folder

        folder = resolve_model_folder(args.model)
        model = AutoModelForCausalLM.from_pretrained(folder, **{dtype_kw: dtype})
    return model.to(device).eval()


def fastest_hf_model(
    args: argparse.Namespace,
    llm: Any,
    prompts: list[list[int]],
    device: torch.device,
    choice: str = "fastest",
) -> tuple[Any, dict[str, Any]]:
    """transformers in ``choice`` (a dtype name), or, for "fastest", in whichever of bf16 and fp32
    generates a probe (the first PROBE_PROMPTS prompts, PROBE_TOKENS new tokens, after a warm-up)
    sooner. Returns the model and what to record: the dtype and each probe's seconds."""
    if choice != "fastest":
        model = load_hf_model(args, llm, HF_DTYPES[choice], device)
        return model, {"hf_dtype": choice}
    probe = prompts[:PROBE_PROMPTS]
    seconds: dict[str, float] = {}
    best: tuple[float, str, Any] | None = None
    for name, dtype in HF_DTYPES.items():
        model = load_hf_model(args, llm, dtype, device)
        hf_generate(model, [list(range(1, 17))], 4, device)  # warm-up: threads, kernels
        seconds[name] = hf_generate(model, probe, PROBE_TOKENS, device)
        if best is None or seconds[name] < best[0]:
            best = (seconds[name], name, model)
        del model
    _, name, model = best
    record = {"hf_dtype": name, "hf_probe_s": {k: round(v, 6) for k, v in seconds.items()}}
    return model, record


def _eos_id(hf_config: Any) -> int | None:
    eos = getattr(hf_config, "eos_token_id", None)
    if isinstance(eos, list | tuple):
        eos = eos[0] if eos else None
    return eos


def hf_generate(model: Any, prompts: list[list[int]], num_new: int, device: torch.device) -> float:
    """One left-padded greedy `generate` of exactly `num_new` tokens per prompt; its seconds."""
    from transformers import GenerationConfig

    eos = _eos_id(model.config)
    pad = eos if eos is not None else 0
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    config = GenerationConfig(
        max_new_tokens=num_new,
        min_new_tokens=num_new,
        do_sample=False,
        pad_token_id=pad,
        eos_token_id=eos,
    )
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    _sync(device)
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids, attention_mask=attention_mask, generation_config=config
        )
    _sync(device)
    elapsed = time.perf_counter() - started
    if out.shape[1] != width + num_new:
        raise RuntimeError(f"transformers generated {out.shape[1] - width} of {num_new} tokens")
    return elapsed


def run_hf(model: Any, workload: Any, device: torch.device) -> float:
    """Seconds for the whole workload; W-nano (mixed output lengths) goes in batches of 64."""
    if len(set(workload.output_lens)) == 1:
        return hf_generate(model, workload.prompts, workload.output_lens[0], device)
    elapsed = 0.0
    for start in range(0, len(workload.prompts), HF_NANO_BATCH):
        batch = slice(start, start + HF_NANO_BATCH)
        elapsed += hf_generate(
            model, workload.prompts[batch], max(workload.output_lens[batch]), device
        )
    return elapsed
