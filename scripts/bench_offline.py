"""Offline throughput of the engine on the DESIGN.md workloads, optionally against transformers.

    .venv/bin/python scripts/bench_offline.py --workload W-mixed [--compare-hf] [--runs 3]
    .venv/bin/python scripts/bench_offline.py --workload W-nano \
        --model config/models/qwen3-0.6b.json --load-format dummy --max-num-seqs 256 \
        --max-num-batched-tokens 8192 --compare-hf
    .venv/bin/python scripts/bench_offline.py --decode-step \
        --model config/models/llama-3.2-1b.json --load-format dummy --max-model-len 4096

Every prompt is submitted at once through ``yaied.LLM.generate`` (greedy, ignore_eos) and the
wall time of that call is measured. One JSON line per run goes to stdout; logs go to stderr.

Workloads (one ``random.Random(seed)`` draws every length first, then the token ids, uniformly
from [0, vocab_size); run k uses seed k, so run 0 is the canonical workload and a later run never
hits the prefix cache filled by an earlier one):

- W-mixed:  32 prompts of 64..512 tokens, 64 output tokens each.
- W-decode: 16 prompts of 32..128 tokens, 256 output tokens each.
- W-prefix: 8 groups x 4 prompts: a shared 1024-token prefix plus 32 own tokens; 32 outputs.
- W-nano:   256 prompts, input and output lengths each uniform in 100..1024.
- W-single: one 512-token prompt, 256 output tokens, alone: TTFT, decode tok/s and the memory
  floor (scripts/single_stream.py); ``--compare-hf`` times transformers' batch-1 ``generate``.
- W-agent:  ``--batch-size`` chat prompts carrying a document to copy (scripts/agent_bench.py).

``--speculative-compare`` runs a workload with n-gram speculation off and on, interleaved, and
reports the ratio of decode tok/s (scripts/agent_bench.py); ``--speculative-method ngram`` alone
runs it on.

``--compare-hf`` runs the same prompts through ``transformers`` ``generate`` in one left-padded
batch (W-nano: batches of 64, each generating its longest output; only the tokens each request
asked for are counted) and reports ``hf_output_tok_s`` and ``ratio`` = ours / hf. transformers
runs in its fastest dtype on this machine (``--hf-dtype fastest``: bf16 and fp32 each time a
probe, the faster runs the workload; scripts/hf_baseline.py), yaied in its default (``auto``).

Every line says what it ran on: the CPU's model name, the ISA level yaied's kernels ran at
(``YAIED_CPU_ISA`` caps it, and a capped run holds torch's kernels to the level too), the math
and weight dtypes, and the copy bandwidth measured in the same process.

``--decode-step`` times one decode step at batch 1 instead (scripts/decode_step.py) and prints
it next to the memory floor: weight bytes / the device's spec bandwidth (H100 3.35 TB/s, H200
4.8 TB/s). ``--num-prompts`` and ``--max-output-len`` cut a workload down for smoke tests.
Nothing here imports the server packages: a GPU box needs only torch, transformers and triton.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from yaied.kernels.cpu_isa import hold_torch_to_cap

hold_torch_to_cap()  # a capped run's torch kernels keep to the cap: set before torch loads

import torch  # noqa: E402
from hf_baseline import fastest_hf_model, hf_generate, run_hf  # noqa: E402
from machine import cpu_model_name  # noqa: E402
from single_stream import copy_bandwidth  # noqa: E402
from tp_comm import comm_counters, comm_record  # noqa: E402

WORKLOADS = ("W-mixed", "W-decode", "W-prefix", "W-nano", "W-single", "W-agent")


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def _random_ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(n)]


def build_workload(name: str, vocab_size: int, seed: int = 0) -> Workload:
    """All lengths are drawn before any token id, so lengths do not depend on the vocabulary."""
    rng = random.Random(seed)
    if name in ("W-mixed", "W-decode"):
        count, low, high, out = (32, 64, 512, 64) if name == "W-mixed" else (16, 32, 128, 256)
        input_lens = [rng.randint(low, high) for _ in range(count)]
        prompts = [_random_ids(rng, n, vocab_size) for n in input_lens]
        return Workload(name, prompts, [out] * count)
    if name == "W-prefix":
        # 8 groups of 4, in group order: g0p0 g0p1 g0p2 g0p3 g1p0 ...
        prompts = []
        for _ in range(8):
            prefix = _random_ids(rng, 1024, vocab_size)
            prompts += [prefix + _random_ids(rng, 32, vocab_size) for _ in range(4)]
        return Workload(name, prompts, [32] * len(prompts))
    if name == "W-single":  # timed by scripts/single_stream.py
        return Workload(name, [_random_ids(rng, 512, vocab_size)], [256])
    if name == "W-nano":
        input_lens = [rng.randint(100, 1024) for _ in range(256)]
        output_lens = [rng.randint(100, 1024) for _ in range(256)]
        prompts = [_random_ids(rng, n, vocab_size) for n in input_lens]
        return Workload(name, prompts, output_lens)
    raise ValueError(f"unknown workload {name!r}; expected one of {', '.join(WORKLOADS)}")


# -- the machine and the model -------------------------------------------------------------------


def engine_dtypes(llm: Any) -> tuple[torch.dtype, torch.dtype]:
    """The engine's math and linear-weight dtypes, as its loader resolved them."""
    info = llm.engine.worker.info
    return getattr(torch, info.dtype), getattr(torch, info.weight_dtype or info.dtype)


def machine_record(llm: Any, bandwidth: float) -> dict[str, Any]:
    """What a figure ran on, for every result line."""
    info = llm.engine.worker.info
    return {
        "cpu": cpu_model_name(),
        "cpu_isa": info.cpu_isa or None,
        "math_dtype": info.dtype,
        "weight_dtype": info.weight_dtype or info.dtype,
        "quantization": info.quantization or None,
        "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1),
    }


def bench_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_matmul_peak_gflops(dtype: torch.dtype, device: torch.device, reps: int = 5) -> float:
    """The best throughput of square matmuls in `dtype`: the machine's practical matmul peak."""
    sizes = (4096, 8192) if device.type == "cuda" else (1024, 1536, 2048)
    best = 0.0
    for n in sizes:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        torch.matmul(a, b)  # warm-up: thread pool, kernel selection
        _sync(device)
        for _ in range(reps):
            started = time.perf_counter()
            torch.matmul(a, b)
            _sync(device)
            best = max(best, 2 * n**3 / (time.perf_counter() - started) / 1e9)
    return best


def matmul_params(hf_config: Any) -> int:
    """Parameters that a token multiplies through: everything but the input embedding, with the
    lm_head counted even when it is tied to the embedding."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # shapes only, no memory
        model = AutoModelForCausalLM.from_config(hf_config)
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    total = sum(p.numel() for p in model.parameters())  # tied tensors counted once
    return total - embedding.numel() + (head.numel() if head is embedding else 0)


# -- our engine ------------------------------------------------------------------------------


def engine_overrides(
    args: argparse.Namespace, threads: int, speculative: bool = False
) -> dict[str, Any]:
    overrides: dict[str, Any] = {
        "load_format": args.load_format,
        "quantization": args.quantization,
        "threads": threads,
        "model_impl": args.model_impl,
        "tensor_parallel_size": args.tensor_parallel_size,
        "speculative_method": "ngram" if speculative else "",
        "num_speculative_tokens": args.num_speculative_tokens,
    }
    if args.speculative_max_batch_size is not None:
        overrides["speculative_max_batch_size"] = args.speculative_max_batch_size
    for name in ("max_num_seqs", "max_num_batched_tokens", "kv_cache_gib", "max_model_len"):
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    if args.gpu_memory_utilization is not None:
        overrides["gpu_memory_utilization"] = args.gpu_memory_utilization
    elif args.compare_hf:
        overrides["gpu_memory_utilization"] = 0.5  # transformers shares the device (GPU only)
    if args.no_prefix_cache:
        overrides["enable_prefix_caching"] = False
    if args.batch_invariant:
        overrides["batch_invariant"] = True
    overrides["overlap_steps"] = args.overlap_steps
    return overrides


def run_engine(llm: Any, workload: Workload) -> tuple[float, int, int, dict[str, float]]:
    """(elapsed seconds, output tokens, cached prompt tokens, deltas of the engine's counters)."""
    from yaied import SamplingParams

    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in workload.output_lens
    ]
    before = llm.stats() | comm_counters(llm)
    started = time.perf_counter()
    outputs = llm.generate(workload.prompts, params)
    elapsed = time.perf_counter() - started
    after = llm.stats() | comm_counters(llm)
    for i, (out, wanted) in enumerate(zip(outputs, workload.output_lens, strict=True)):
        error = getattr(out, "error", None)
        if error or len(out.token_ids) != wanted:
            raise RuntimeError(
                f"request {i}: {len(out.token_ids)} of {wanted} tokens, "
                f"finish_reason={out.finish_reason}, error={error}"
            )
    deltas = {
        key: after[key] - before.get(key, 0)
        for key in ("prefix_cache_queries", "prefix_cache_hits", "num_steps", "num_preemptions")
        + ("comm_s", "num_collectives")
        if key in after
    }
    output_tokens = sum(len(out.token_ids) for out in outputs)
    cached = sum(out.num_cached_tokens or 0 for out in outputs)
    return elapsed, output_tokens, cached, deltas


# -- main ------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=WORKLOADS)
    parser.add_argument(
        "--decode-step", action="store_true", help="time a batch-1 decode step instead"
    )
    parser.add_argument("--decode-steps", type=int, default=128, help="steps per timing")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument(
        "--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32")
    )
    parser.add_argument(
        "--hf-dtype",
        default="fastest",
        choices=("fastest", "bfloat16", "float32"),
        help="transformers' dtype; fastest: bf16 and fp32 each time a probe, the faster runs",
    )
    parser.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    parser.add_argument(
        "--quantization",
        default="none",
        choices=("none", "auto", "gguf", "q8_0", "q4_0"),
        help="model.quantization: the projections kept in blocks (README, Quantized weights)",
    )
    parser.add_argument(
        "--model-impl",
        default="native",
        choices=("native", "transformers", "auto"),
        help="the engine's model implementation (transformers: its own class on our KV cache)",
    )
    parser.add_argument("--no-prefix-cache", action="store_true", help="disable prefix caching")
    parser.add_argument(
        "--batch-invariant", action="store_true", help="engine.batch_invariant (CPU)"
    )
    parser.add_argument(
        "--overlap-steps",
        default="auto",
        choices=("auto", "on", "off"),
        help="engine.overlap_steps (auto: on a GPU)",
    )
    parser.add_argument("--compare-hf", action="store_true", help="also time transformers generate")
    parser.add_argument("--runs", type=int, default=1, help="timed runs; run k uses seed k")
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0 = every core")
    parser.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="ranks; CPU splits cores"
    )
    parser.add_argument("--max-num-seqs", type=int)
    parser.add_argument("--max-num-batched-tokens", type=int)
    parser.add_argument("--kv-cache-gib", type=float)
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        help="the engine's share of GPU memory (default 0.9; 0.5 with --compare-hf, so that "
        "transformers in the same process has room)",
    )
    parser.add_argument("--num-prompts", type=int, help="only the first N prompts (smoke tests)")
    parser.add_argument("--max-output-len", type=int, help="cap each output (smoke tests)")
    parser.add_argument("--no-peak", action="store_true", help="skip the matmul peak")
    parser.add_argument("--batch-size", type=int, default=1, help="W-agent: prompts at once")
    parser.add_argument("--speculative-method", choices=("", "ngram"), default="")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--speculative-max-batch-size", type=int)
    parser.add_argument("--speculative-compare", action="store_true", help="off vs on")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    if (args.workload is None) == (not args.decode_step):
        parser.error("give either --workload or --decode-step")
    if args.decode_step and args.compare_hf:
        parser.error("--compare-hf goes with a --workload")
    return args


def trim_workload(workload: Workload, num_prompts: int | None, max_output: int | None) -> Workload:
    """The first num_prompts prompts, outputs capped at max_output (None: unchanged)."""
    prompts = workload.prompts[:num_prompts]
    outputs = workload.output_lens[: len(prompts)]
    if max_output is not None:
        outputs = [min(n, max_output) for n in outputs]
    return Workload(workload.name, prompts, outputs)


def _log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    device = bench_device()

    from yaied import LLM, SamplingParams

    _log(f"loading {args.model} ({args.dtype}, load_format={args.load_format})")
    if args.speculative_compare or args.workload == "W-agent":
        from agent_bench import run_agent

        def make_llm(speculative: bool) -> Any:
            overrides = engine_overrides(args, threads, speculative)
            return LLM(model=args.model, dtype=args.dtype, show_progress=False, **overrides)

        run_agent(args, make_llm)
        return
    speculative = bool(args.speculative_method)
    llm = LLM(model=args.model, dtype=args.dtype, **engine_overrides(args, threads, speculative))

    # transformers, the matmul peak and the copy each run on a thread that then ends: a live
    # thread that has run a parallel torch op keeps an OpenMP team, which competes with the
    # worker's for the cores on every later step (a batch-1 decode ran 35% slower, 54 against
    # 82-88 tok/s); a thread that ends takes its team with it. The daemon has no such thread.
    def on_reference_thread(fn: Any, *fn_args: Any) -> Any:
        return run_in_passing_thread(threads, fn, *fn_args)

    try:
        llm.generate(
            [list(range(1, 17))], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        )
        dtype, weight_dtype = engine_dtypes(llm)
        bandwidth = on_reference_thread(copy_bandwidth)
        machine = machine_record(llm, bandwidth)
        _log(f"on {machine}")
        hf_model, hf_record = None, {}
        if args.compare_hf:
            _log(f"loading the transformers model ({args.hf_dtype})")
            probe = build_workload(args.workload or "W-mixed", llm.vocab_size).prompts
            hf_model, hf_record = on_reference_thread(
                fastest_hf_model, args, llm, probe, device, args.hf_dtype
            )
            _log(f"transformers: {hf_record}")
            on_reference_thread(hf_generate, hf_model, [list(range(1, 17))], 4, device)
        params = matmul_params(llm.hf_config)
        if args.decode_step:
            from decode_step import decode_step_record

            _log(f"timing batch-1 decode steps ({args.decode_steps} per timing)")
            record = decode_step_record(
                llm, args.model, params, weight_dtype, device, args.decode_steps
            )
            print(json.dumps(record | machine), flush=True)
            return
        peak = 0.0
        if not args.no_peak:
            _log("measuring the matmul peak")
            peak = on_reference_thread(measure_matmul_peak_gflops, dtype, device)
        for run in range(args.runs):
            workload = build_workload(args.workload, llm.vocab_size, seed=run)
            workload = trim_workload(workload, args.num_prompts, args.max_output_len)
            _log(f"run {run}: {args.workload}, {len(workload.prompts)} requests")
            if args.workload == "W-single":
                from single_stream import single_stream_record

                record = {"workload": args.workload, "model": args.model, "dtype": args.dtype}
                record |= {"device": str(device), "threads": threads, "seed": run}
                prompt = workload.prompts[0]
                record |= single_stream_record(
                    llm, hf_model, prompt, run, params, (weight_dtype, dtype), device,
                    on_reference_thread,
                )  # fmt: skip
            else:
                record = _run_once(args, llm, workload, run, peak, params, device)
                if hf_model is not None:
                    add_hf(record, on_reference_thread(run_hf, hf_model, workload, device))
            print(json.dumps(record | machine | hf_record), flush=True)
    finally:
        llm.close()


def run_in_passing_thread(threads: int, fn: Any, *args: Any) -> Any:
    """``fn(*args)`` on a new thread with ``threads`` torch threads; its result or exception."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        torch.set_num_threads(threads)
        try:
            outcome["value"] = fn(*args)
        except BaseException as exc:  # re-raised on the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="reference")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def add_hf(record: dict[str, Any], hf_elapsed: float) -> None:
    hf_tok_s = record["output_tokens"] / hf_elapsed
    record["hf_elapsed_s"] = round(hf_elapsed, 3)
    record["hf_output_tok_s"] = round(hf_tok_s, 2)
    record["ratio"] = round(record["output_tok_s"] / hf_tok_s, 3)


def _run_once(
    args: argparse.Namespace,
    llm: Any,
    workload: Workload,
    seed: int,
    peak: float,
    params: int,
    device: torch.device,
) -> dict[str, Any]:
    elapsed, output_tokens, cached, deltas = run_engine(llm, workload)
    prompt_tokens = workload.num_prompt_tokens
    # Approximate: 2 FLOPs per parameter per token computed (prompt tokens not served from the
    # prefix cache, plus outputs), ignoring attention's own FLOPs and that prefill runs lm_head
    # only for the last position. Good enough to place us against the machine's matmul peak.
    achieved = 2 * params * (prompt_tokens - cached + output_tokens) / elapsed / 1e9
    record: dict[str, Any] = {
        "workload": workload.name,
        "model": args.model,
        "dtype": args.dtype,
        "load_format": args.load_format,
        "quantization": args.quantization,
        "model_impl": args.model_impl,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "seed": seed,
        "num_requests": len(workload.prompts),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "cached_prompt_tokens": cached,
        "elapsed_s": round(elapsed, 3),
        "output_tok_s": round(output_tokens / elapsed, 2),
        "total_tok_s": round((prompt_tokens + output_tokens) / elapsed, 2),
        "matmul_peak_gflops": round(peak, 1),
        "achieved_gflops": round(achieved, 1),
        "roofline_share": round(achieved / peak, 4) if peak else None,
    }
    if deltas.get("prefix_cache_queries"):
        record["prefix_cache_hit_rate"] = round(
            deltas["prefix_cache_hits"] / deltas["prefix_cache_queries"], 4
        )
    record.update({k: v for k, v in deltas.items() if k in ("num_steps", "num_preemptions")})
    record.update(comm_record(deltas, elapsed))
    return record


if __name__ == "__main__":
    main()
