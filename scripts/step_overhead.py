"""The engine's own time per decode step: everything a step costs besides the worker's call.

32 requests decode together (by default); each step is timed whole and the worker's
``execute`` inside it is timed apart, so the difference is the engine task's Python work per step:
draining the inbox, scheduling, the scheduler's update, detokenizing, the invariant checks and
handing each event to its sink. Prints one JSON line with medians over the timed steps.

    .venv/bin/python scripts/step_overhead.py            # default model, 32 decode rows
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rows", type=int, default=32, help="requests decoding at once")
    parser.add_argument("--steps", type=int, default=100, help="timed decode steps")
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()

    from yaied.core.config import load_config
    from yaied.engine.async_engine import AsyncEngine

    config = load_config(env={}, overrides={"model": args.model, "threads": args.threads})
    engine = AsyncEngine(config, show_progress=False)
    rng = random.Random(0)
    for i in range(args.rows):
        prompt = [rng.randrange(100, 20000) for _ in range(64)]
        _submit(engine, prompt, args.steps + 50, f"r{i}")

    worker_seconds = [0.0]
    execute = engine.worker.execute

    def timed_execute(batch):
        started = time.perf_counter()
        try:
            return execute(batch)
        finally:
            worker_seconds[0] += time.perf_counter() - started

    engine.worker.execute = timed_execute
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or (
        engine.scheduler.waiting or engine._inbox
    ):
        engine.step()  # prefill until every request decodes
    totals, workers = [], []
    for _ in range(args.steps):
        worker_seconds[0] = 0.0
        started = time.perf_counter()
        engine.step()
        totals.append(time.perf_counter() - started)
        workers.append(worker_seconds[0])
    engine_part = [t - w for t, w in zip(totals, workers, strict=True)]
    print(
        json.dumps(
            {
                "rows": args.rows,
                "steps": args.steps,
                "step_ms": round(statistics.median(totals) * 1e3, 3),
                "worker_ms": round(statistics.median(workers) * 1e3, 3),
                "engine_ms": round(statistics.median(engine_part) * 1e3, 3),
            }
        )
    )


def _submit(engine, prompt: list[int], max_tokens: int, request_id: str) -> None:
    from yaied.core.request import SamplingParams
    from yaied.core.stream import EventStream

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    stream: EventStream[None] = EventStream()
    engine.add_request(prompt, params, sink=stream.sink(None), request_id=request_id)


if __name__ == "__main__":
    main()
