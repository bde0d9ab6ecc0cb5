"""Where the engine's time goes: torch.profiler over one batch of decode-heavy requests.

    python scripts/profile_steps.py --model config/models/qwen3-0.6b.json --load-format dummy \\
        --requests 256 --prompt-len 600 --output-len 64

Prints the CUDA kernels that took the most device time, and the share of the wall time the device
was busy: a low share means the host (Python, scheduling, launches) is what a step waits for, not
the kernels. CUDA only: torch's profiler records host operators of the calling thread, and the
engine's worker thread runs them (on CPU, use `perf record` on the process instead).
Random prompts, greedy, `ignore_eos`; a warm-up batch first, so that compilation and graph capture
are not in the profile.
"""

from __future__ import annotations

import argparse
import random
import time

from torch.profiler import ProfilerActivity, profile

from yaied import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded default model")
    parser.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=600)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--top", type=int, default=25, help="rows of the table")
    args = parser.parse_args()

    kwargs = {"model": args.model} if args.model else {}
    llm = LLM(
        **kwargs,
        load_format=args.load_format,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False,  # every batch prefills in full, as the first one did
        show_progress=False,
    )
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)

    def batch() -> list[list[int]]:
        return [
            [rng.randrange(llm.vocab_size) for _ in range(args.prompt_len)]
            for _ in range(args.requests)
        ]

    llm.generate(batch(), params)  # warm-up
    if llm.engine.worker.device.type != "cuda":
        raise SystemExit("profile_steps.py: needs a CUDA device (on CPU, use perf record)")
    prompts = batch()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        llm.generate(prompts, params)
        wall = time.perf_counter() - started
    events = prof.key_averages()
    print(events.table(sort_by="self_cuda_time_total", row_limit=args.top))
    tokens = args.requests * args.output_len
    print(f"wall {wall:.3f} s for {tokens} output tokens ({tokens / wall:.0f} tok/s, profiled)")
    busy_us = sum(e.self_device_time_total for e in events)
    print(f"device busy {busy_us / 1e6:.3f} s = {busy_us / 1e6 / wall:.2f} of the wall time")


if __name__ == "__main__":
    main()
