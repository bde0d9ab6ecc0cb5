"""Compare the scheduler's queue policies on simulated agentic workloads.

Drives the real Scheduler (yaied/engine/simulator.py) with a cost model instead of a model and
prints, for each workload and program arrival rate, one line per policy with the program-level
token latency (program response time / output tokens, seconds):

    PYTHONPATH=. python scripts/sim_scheduler.py
    PYTHONPATH=. python scripts/sim_scheduler.py --workloads mix --rates 0.8 --programs 300
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from yaied.core.config import SchedulerConfig
from yaied.engine.policy import POLICIES
from yaied.engine.sim_workloads import LENGTHS, WORKLOADS, make_workload
from yaied.engine.simulator import CostModel, EngineShape, Simulator, latency_stats

# Rates in programs/second per workload, from light to overloaded for the default engine below
# (its capacity is about 0.6 programs/s of the mix; the long tail of program lengths keeps a
# backlog long after arrivals stop at the higher rates).
DEFAULT_RATES = {
    "chat": (0.5, 0.75, 1.0),
    "react": (0.4, 0.7, 1.0),
    "mcts": (0.4, 0.7, 1.0),
    "mix": (0.6, 0.8, 1.0),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--rates", nargs="+", type=float, help="programs/s (default: per workload)")
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.add_argument("--programs", type=int, default=300, help="programs per run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-pages", type=int, default=EngineShape().num_pages)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--overhead", type=float, default=CostModel().overhead_s, help="s per step")
    parser.add_argument("--per-token", type=float, default=CostModel().per_token_s, help="s/token")
    parser.add_argument("--no-extend", action="store_true", help="calls do not share context")
    parser.add_argument("--lengths", choices=LENGTHS, default="lognormal", help="program lengths")
    parser.add_argument("--base-quantum", type=float, default=0.5, help="seconds (mlfq/plas)")
    args = parser.parse_args()
    base = SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        base_quantum_s=args.base_quantum,
    )
    engine = EngineShape(num_pages=args.num_pages)
    cost = CostModel(args.overhead, args.per_token)
    print(
        f"# engine: {args.num_pages} pages x {engine.page_size} tokens, max_num_seqs "
        f"{args.max_num_seqs}, budget {args.max_num_batched_tokens} tokens/step; step time = "
        f"{cost.overhead_s} s + {cost.per_token_s} s/token; {args.programs} programs per run"
    )
    print("# token latency = program response time / program output tokens, seconds")
    for workload in args.workloads:
        for rate in args.rates or DEFAULT_RATES[workload]:
            programs = make_workload(
                workload,
                num_programs=args.programs,
                rate=rate,
                seed=args.seed,
                lengths=args.lengths,
                extend_context=not args.no_extend,
            )
            for policy in args.policies:
                config = dataclasses.replace(base, policy=policy)
                started = time.perf_counter()
                result = Simulator(config, engine=engine, cost=cost, seed=args.seed).run(programs)
                stats = latency_stats([p.token_latency for p in result.programs])
                print(
                    f"{workload:5s} rate={rate:<5g} {policy:8s} {stats}  "
                    f"preemptions={result.num_preemptions} steps={result.num_steps} "
                    f"sim_time={result.end_time:.0f}s ({time.perf_counter() - started:.1f}s)",
                    flush=True,
                )


if __name__ == "__main__":
    main()
