"""Run the stateful engine fuzzer (tests/engine/engine_fuzz.py) with fresh seeds for a while.

    .venv/bin/python scripts/fuzz_engine.py --minutes 30
    .venv/bin/python scripts/fuzz_engine.py --minutes 2 --policy priority --carry-cache

CI runs a fixed, derandomized profile of the same state machine (tests/engine/test_engine_fuzz.py).
This script runs hypothesis again and again with new random seeds (``--examples`` examples of up
to ``--rules`` rules each per run) until the time is up, over one engine built at the start. It
prints one JSON summary at the end: runs, examples, rules, engine steps, requests and what
became of them, what the oracle compared, and the coverage counters (preempted, chunked, prefix
hits, stop strings). On the first failure it prints hypothesis's minimal failing example (a
sequence of rules, to paste into a test) and the summary so far, and exits 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests import conftest  # noqa: E402, F401  (sets TRITON_INTERPRET where CUDA is absent)
from tests.engine.engine_fuzz import (  # noqa: E402  (the repository root must be on the path)
    FuzzSetup,
    FuzzWorld,
    build_model_folder,
    fuzz_settings,
    run,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=1.0, help="how long to fuzz")
    parser.add_argument("--examples", type=int, default=100, help="examples per hypothesis run")
    parser.add_argument("--rules", type=int, default=50, help="most rules per example")
    parser.add_argument("--policy", default="fcfs", choices=["fcfs", "priority", "mlfq", "plas"])
    parser.add_argument("--num-pages", type=int, default=FuzzSetup.num_pages)
    parser.add_argument("--max-model-len", type=int, default=FuzzSetup.max_model_len)
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=FuzzSetup.max_num_batched_tokens
    )
    parser.add_argument("--max-num-seqs", type=int, default=FuzzSetup.max_num_seqs)
    parser.add_argument("--page-size", type=int, default=FuzzSetup.page_size)
    parser.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "torch", "triton"],
        help="triton runs in Triton's interpreter on CPU, about 500x slower per step",
    )
    parser.add_argument(
        "--carry-cache",
        action="store_true",
        help="keep the prefix cache across examples (more state; a failure may not replay)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup = FuzzSetup(
        num_pages=args.num_pages,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        page_size=args.page_size,
        attention_backend=args.attention_backend,
        policy=args.policy,
        carry_cache=args.carry_cache,
    )
    fuzz = fuzz_settings(max_examples=args.examples, stateful_step_count=args.rules)
    with tempfile.TemporaryDirectory(prefix="yaied-fuzz-") as tmp:
        world = FuzzWorld(build_model_folder(Path(tmp)), setup)
        start = time.monotonic()
        end = start + args.minutes * 60
        runs, failed = 0, False
        try:
            while time.monotonic() < end:
                run(world, fuzz)
                runs += 1
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
        except Exception:
            failed = True
            traceback.print_exc()
        finally:
            world.close()
        summary = {
            "seconds": round(time.monotonic() - start, 1),
            "setup": vars(args),
            "runs": runs,
            "failed": failed,
            **dict(sorted(world.stats.items())),
        }
        print(json.dumps(summary, indent=1))
        return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
