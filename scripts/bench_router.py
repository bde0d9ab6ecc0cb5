"""W-sessions: the router's policies compared on two CPU engine processes.

    PYTHONPATH=. .venv/bin/python scripts/bench_router.py
    PYTHONPATH=. .venv/bin/python scripts/bench_router.py --sessions 4 --turns 2   # a smoke run
    PYTHONPATH=. .venv/bin/python scripts/bench_router.py --elastic   # the autoscaler: see
                                                        # scripts/bench_elastic.py
    PYTHONPATH=. .venv/bin/python scripts/bench_router.py --policies autellix --kinds local,ray
                                            # the same engines as processes, then as Ray actors

16 sessions x 6 turns. A session starts from a 2,500-token context of its own (random ids); each
turn sends the whole context, gets 32 tokens (greedy, ignore_eos), and the next turn appends those
and 200 new tokens. Sessions arrive as a Poisson process (``--rate`` per second) and run their
turns back to back; the default rate (8/s) brings all 16 in within about two seconds, so their
contexts are live together however fast the machine is (at 2/s an idle 2-core box finishes early
sessions before late ones arrive, and round_robin then keeps 60% hits). Two local engine
processes (``--threads`` each) serve a small random-weight Llama with a KV pool of
``--kv-tokens`` (32k) each: less than all sessions' contexts together, so where a session's turns
land decides what the prefix cache can keep.

For each policy in turn (fresh engines, so caches start cold) it prints the prefix-cache hit rate
(cached / prompt tokens, as the engines report them), output tokens/s over the whole run, and mean
and p99 time to first token; then autellix's ratios over round_robin. One JSON line per policy
goes to stdout as well.

``--kinds local,ray`` runs each policy on each kind of engine in turn: local engine processes,
then Ray actors (``kind = "ray"``, ``{CPU = --threads}`` each, on a Ray instance started here),
and prints the Ray engines' throughput and hit rate against the local ones'. ``--repeat N``
runs every kind N times, alternating, and keeps each kind's run of median throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import bench_elastic  # scripts/: python puts the script's folder first on sys.path
import numpy as np

from yaied.core.config import load_config
from yaied.core.request import SamplingParams
from yaied.router.build import build_manager
from yaied.router.config import EngineEntry, RouterConfig
from yaied.router.manager import EngineManager

POLICIES = ("autellix", "round_robin", "least_loaded")


def model_config(args: argparse.Namespace) -> dict:
    """A small Llama: cheap per token, yet prefill dominates a 3k-token turn, as on a real one."""
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": args.hidden,
        "intermediate_size": 3 * args.hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.hidden // 32,
        "num_key_value_heads": max(1, args.hidden // 64),
        "vocab_size": 2048,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    }


def kv_cache_gib(config: dict, kv_tokens: int) -> float:
    """The pool size that holds ``kv_tokens`` tokens (bfloat16 K and V, every layer)."""
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 2
    return kv_tokens * per_token / 2**30


@dataclass(slots=True)
class Turn:
    session: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    ttft: float


@dataclass(slots=True)
class Run:
    policy: str
    turns: list[Turn] = field(default_factory=list)
    seconds: float = 0.0
    per_engine: dict[str, int] = field(default_factory=dict)

    def summary(self) -> dict:
        prompt = sum(t.prompt_tokens for t in self.turns)
        cached = sum(t.cached_tokens for t in self.turns)
        ttft = np.array([t.ttft for t in self.turns])
        return {
            "policy": self.policy,
            "calls": len(self.turns),
            "hit_rate": cached / prompt if prompt else 0.0,
            "output_tok_s": sum(t.output_tokens for t in self.turns) / self.seconds,
            "mean_ttft_s": float(ttft.mean()),
            "p99_ttft_s": float(np.percentile(ttft, 99)),
            "seconds": self.seconds,
            "calls_per_engine": self.per_engine,
        }


async def session(manager: EngineManager, index: int, args: argparse.Namespace, run: Run) -> None:
    rng = random.Random(args.seed * 1000 + index)
    context = [rng.randrange(2048) for _ in range(args.context)]
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True)
    for turn in range(args.turns):
        started = time.perf_counter()
        handle = await manager.submit_request(
            session_id=f"s{index}", prompt=context, sampling_params=params
        )
        first, output, last = None, [], None
        async for event in handle:
            if first is None and event.token_ids:
                first = time.perf_counter()
            output.extend(event.token_ids)
            last = event
        if last.error is not None:
            raise RuntimeError(f"session {index} turn {turn}: {last.error}")
        run.turns.append(
            Turn(index, len(context), last.num_cached_tokens, len(output), first - started)
        )
        run.per_engine[handle.engine_id] = run.per_engine.get(handle.engine_id, 0) + 1
        context = context + output + [rng.randrange(2048) for _ in range(args.turn_tokens)]


def engine_entries(kind: str, args: argparse.Namespace) -> tuple[EngineEntry, ...]:
    if kind == "ray":
        resources = (("CPU", float(args.threads)),)
        entry = EngineEntry(kind="ray", device="cpu", threads=args.threads, resources=resources)
    else:
        entry = EngineEntry(device="cpu", threads=args.threads)
    return (entry,) * args.engines


async def run_policy(
    policy: str, args: argparse.Namespace, model_path: Path, gib: float, kind: str = "local"
) -> Run:
    engine_config = load_config(
        env={},
        overrides={
            "model": str(model_path),
            "load_format": "dummy",
            "kv_cache_gib": gib,
            "max_num_batched_tokens": args.step_tokens,
        },
    )
    entries = engine_entries(kind, args)
    manager = build_manager(engine_config, RouterConfig(policy=policy), entries)
    await manager.start()
    try:
        run = Run(policy if kind == "local" else f"{policy}/{kind}")
        arrivals = random.Random(args.seed)
        tasks = []
        started = time.perf_counter()
        for index in range(args.sessions):
            tasks.append(asyncio.create_task(session(manager, index, args, run)))
            await asyncio.sleep(arrivals.expovariate(args.rate))
        await asyncio.gather(*tasks)
        run.seconds = time.perf_counter() - started
        return run
    finally:
        await manager.stop()


def report(results: dict[str, dict], args: argparse.Namespace) -> None:
    def say(line: str) -> None:
        print(line, file=sys.stderr)

    say(
        f"\nW-sessions: {args.sessions} sessions x {args.turns} turns, {args.engines} CPU "
        f"engines x {args.threads} thread(s), KV {args.kv_tokens} tokens each"
    )
    say(f"{'policy':<14}{'hit rate':>10}{'out tok/s':>11}{'TTFT mean':>11}{'TTFT p99':>10}")
    for name, s in results.items():
        say(
            f"{name:<14}{s['hit_rate']:>10.1%}{s['output_tok_s']:>11.1f}"
            f"{s['mean_ttft_s']:>10.2f}s{s['p99_ttft_s']:>9.2f}s"
        )
    if "autellix" in results and "round_robin" in results:
        a, r = results["autellix"], results["round_robin"]
        hits = a["hit_rate"] / r["hit_rate"] if r["hit_rate"] else float("inf")
        speed = a["output_tok_s"] / r["output_tok_s"]
        say(f"autellix / round_robin: hit rate x{hits:.2f}, throughput x{speed:.2f}")
    for name, s in results.items():
        policy, _, kind = name.partition("/")
        if kind and policy in results:
            local = results[policy]
            speed = s["output_tok_s"] / local["output_tok_s"]
            say(
                f"{policy}: {kind} / local engines: throughput x{speed:.3f}, hit rate "
                f"{s['hit_rate']:.1%} vs {local['hit_rate']:.1%}"
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--context", type=int, default=2500, help="first turn's prompt tokens")
    parser.add_argument("--turn-tokens", type=int, default=200, help="new tokens per turn")
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--rate", type=float, default=8.0, help="session arrivals per second")
    parser.add_argument("--kv-tokens", type=int, default=32768, help="KV pool per engine")
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per engine")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--step-tokens", type=int, default=1024, help="token budget per step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--elastic", action="store_true", help="the autoscaler's ramp instead")
    parser.add_argument(
        "--kinds", default="local", help="engine kinds to run each policy on: local,ray"
    )
    parser.add_argument(
        "--repeat", type=int, default=1, help="runs of each policy and kind; the median is kept"
    )
    bench_elastic.add_arguments(parser)
    args = parser.parse_args()
    if args.elastic:
        return bench_elastic.run(args)
    config = model_config(args)
    gib = kv_cache_gib(config, args.kv_tokens)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_path = Path(tmp) / "w-sessions-llama.json"
        model_path.write_text(json.dumps(config))
        for policy in args.policies.split(","):
            runs: dict[str, list[dict]] = {}
            for _ in range(args.repeat):  # kinds alternate, so load on a shared box hits both
                for kind in args.kinds.split(","):
                    run = asyncio.run(run_policy(policy, args, model_path, gib, kind))
                    summary = run.summary()
                    runs.setdefault(summary["policy"], []).append(summary)
                    print(json.dumps(summary), flush=True)
            for name, summaries in runs.items():  # the run of median throughput
                summaries.sort(key=lambda s: s["output_tok_s"])
                results[name] = summaries[len(summaries) // 2]
    report(results, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
