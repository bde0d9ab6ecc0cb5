"""Program-level scheduling on the real engine: the same comparison as sim_scheduler.py, with the
model running on this machine.

Programs (yaied/engine/sim_workloads.py, token counts scaled down for a small CPU model) arrive
as a Poisson process; each sends its calls stage by stage through ``AsyncEngine.generate`` with
its session id, later calls extending the previous context. For each policy a fresh engine runs
the same programs; one line per policy gives the program-level token latency (response time /
output tokens, seconds):

    PYTHONPATH=. python scripts/bench_programs.py                       # default model, CPU
    PYTHONPATH=. python scripts/bench_programs.py --programs 16 --rate 1.0 --policies fcfs plas
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

from yaied.core.config import load_config
from yaied.engine.async_engine import AsyncEngine
from yaied.engine.policy import POLICIES
from yaied.engine.sim_workloads import WORKLOADS, ProgramSpec, make_workload
from yaied.engine.simulator import latency_stats


async def run_program(
    engine: AsyncEngine, spec: ProgramSpec, start: float, rng: random.Random
) -> float:
    """Send the program's calls; returns its response time."""
    vocab = engine.info.vocab_size
    await asyncio.sleep(max(0.0, start + spec.arrival - time.perf_counter()))
    context: list[int] = []
    for stage in spec.stages:
        prompts = [context + [rng.randrange(vocab) for _ in range(c.prompt_len)] for c in stage]
        calls = [
            collect(engine, prompt, c.output_len, spec.program_id)
            for prompt, c in zip(prompts, stage, strict=True)
        ]
        outputs = await asyncio.gather(*calls)
        if spec.extend_context:
            context = prompts[0] + outputs[0]
    return time.perf_counter() - (start + spec.arrival)


async def collect(engine: AsyncEngine, prompt: list[int], max_tokens: int, session: str):
    stream = engine.generate(
        prompt, session_id=session, max_tokens=max_tokens, temperature=0.0, ignore_eos=True
    )
    return [t async for event in stream for t in event.token_ids]


async def run_policy(args: argparse.Namespace, policy: str, programs: list[ProgramSpec]) -> str:
    overrides = {
        "policy": policy,
        "base_quantum_s": args.base_quantum,
        "max_num_seqs": args.max_num_seqs,
    }
    if args.model:
        overrides["model"] = args.model
    engine = AsyncEngine(load_config(args.config, overrides=overrides), show_progress=False)
    try:
        rng = random.Random(args.seed)
        started = time.perf_counter()
        tasks = [run_program(engine, spec, started, rng) for spec in programs]
        responses = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - started
        stats = engine.stats()
    finally:
        await engine.shutdown()
    latencies = [r / p.num_output_tokens for r, p in zip(responses, programs, strict=True)]
    return (
        f"{args.workload:5s} rate={args.rate:<5g} {policy:8s} {latency_stats(latencies)}  "
        f"preemptions={stats['num_preemptions']} steps={stats['num_steps']} wall={elapsed:.0f}s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=WORKLOADS, default="mix")
    parser.add_argument("--programs", type=int, default=6)
    parser.add_argument("--rate", type=float, default=0.5, help="programs per second")
    parser.add_argument("--token-scale", type=float, default=0.05)
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=["fcfs", "plas"])
    parser.add_argument("--base-quantum", type=float, default=0.5, help="seconds (mlfq/plas)")
    # Few seats, so that calls queue on a CPU: the policies only differ when something waits.
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--model", default="", help="default: the config's model")
    parser.add_argument("--config", default=None, help="a yaied.toml")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    programs = make_workload(
        args.workload,
        num_programs=args.programs,
        rate=args.rate,
        seed=args.seed,
        token_scale=args.token_scale,
    )
    calls = sum(p.num_calls for p in programs)
    tokens = sum(p.num_output_tokens for p in programs)
    print(f"# {len(programs)} programs, {calls} calls, {tokens} output tokens")
    print("# token latency = program response time / program output tokens, seconds")
    for policy in args.policies:
        print(asyncio.run(run_policy(args, policy, programs)), flush=True)


if __name__ == "__main__":
    main()
