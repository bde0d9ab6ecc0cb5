"""The engine's own time per decode step: everything a step costs besides the worker's call.

32 requests decode together (by default); each step is timed whole and the worker's
``execute`` inside it is timed apart, so the difference is the engine task's Python work per step:
draining the inbox, scheduling, the scheduler's update, detokenizing, the invariant checks and
handing each event to its sink. Prints one JSON line with medians over the timed steps.

``python_share`` then estimates how much of the worker's ``execute`` is Python rather than native
work, over ``--profile-steps`` more steps under torch.profiler (in the worker thread): 1 - (time in
top-level torch ops and the ctypes C kernels) / (wall time of execute). The profiler's own cost
per op lands on both sides, so read it as an estimate, and compare runs taken the same way.

    .venv/bin/python scripts/step_overhead.py            # default model, 32 decode rows
    .venv/bin/python scripts/step_overhead.py --rows 1   # one stream
    .venv/bin/python scripts/step_overhead.py --freeze   # the loaded objects frozen, as served

``gc_*`` say what the garbage collector took during the timed steps, by generation.
"""

from __future__ import annotations

import argparse
import gc
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
    parser.add_argument(
        "--quantization", default="none", help="model.quantization (gguf, q8_0, ...)"
    )
    parser.add_argument("--profile-steps", type=int, default=20, help="0: no python_share")
    parser.add_argument(
        "--freeze", action="store_true", help="freeze the loaded objects first, as the daemon does"
    )
    args = parser.parse_args()

    from yaied.core.config import load_config
    from yaied.engine.async_engine import AsyncEngine

    config = load_config(
        env={},
        overrides={"model": args.model, "threads": args.threads, "quantization": args.quantization},
    )
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
    if args.freeze:
        from yaied.core.processes import freeze_loaded_objects

        freeze_loaded_objects()
    collections = _CollectorClock()
    totals, workers = [], []
    for _ in range(args.steps):
        worker_seconds[0] = 0.0
        started = time.perf_counter()
        engine.step()
        totals.append(time.perf_counter() - started)
        workers.append(worker_seconds[0])
    collections.stop()
    engine_part = [t - w for t, w in zip(totals, workers, strict=True)]
    record = {
        "rows": args.rows,
        "steps": args.steps,
        "step_ms": round(statistics.median(totals) * 1e3, 3),
        "worker_ms": round(statistics.median(workers) * 1e3, 3),
        "engine_ms": round(statistics.median(engine_part) * 1e3, 3),
        # The garbage collector during the timed steps, by generation (0, 1, 2).
        "gc_collections": collections.count,
        "gc_ms": [round(t * 1e3, 2) for t in collections.seconds],
        "gc_longest_ms": [round(t * 1e3, 2) for t in collections.longest],
        "frozen": args.freeze,
    }
    if args.profile_steps:
        record["python_share"] = round(_python_share(engine, args.profile_steps, worker_seconds), 3)
    print(json.dumps(record))


class _CollectorClock:
    """Times the garbage collector's passes (gc.callbacks) until stop()."""

    def __init__(self) -> None:
        self.count, self.seconds, self.longest = [0, 0, 0], [0.0] * 3, [0.0] * 3
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        generation, took = info["generation"], time.perf_counter() - self._started
        self.count[generation] += 1
        self.seconds[generation] += took
        self.longest[generation] = max(self.longest[generation], took)

    def stop(self) -> None:
        gc.callbacks.remove(self._callback)


def _python_share(engine, steps: int, worker_seconds: list[float]) -> float:
    """1 - native time / execute's wall time over `steps` decode steps, profiled in the worker
    thread (torch.profiler records the thread that starts it)."""
    from torch.profiler import ProfilerActivity, profile

    runner = engine.worker.runner
    _mark_native(runner)
    profiler = profile(activities=[ProfilerActivity.CPU])
    engine._executor.submit(profiler.__enter__).result()
    worker_seconds[0] = 0.0
    for _ in range(steps):
        engine.step()
    engine._executor.submit(profiler.__exit__, None, None, None).result()
    top_level = [e for e in profiler.events() if e.cpu_parent is None]
    native_us = sum(e.time_range.elapsed_us() for e in top_level)
    return 1 - native_us / 1e6 / worker_seconds[0]


def _mark_native(runner) -> None:
    """Wrap the C kernels (ctypes calls, invisible to the profiler) in profiler ranges."""
    from torch.profiler import record_function

    def marked(function):
        def call(*args, **kwargs):
            with record_function("ctypes kernel"):
                return function(*args, **kwargs)

        return call

    ops = getattr(runner.model, "fused_ops", None)
    if ops is not None:
        for name in ("add_rms_norm", "rotary", "silu_mul"):
            setattr(ops, name, marked(getattr(ops, name)))
    inputs = runner.packer  # the step's attention metadata carries the kernels it holds
    if inputs.prefill_kernel is not None:
        inputs.prefill_kernel = marked(inputs.prefill_kernel)
    kernel = inputs.decode_kernel
    if kernel is not None:

        class MarkedDecodeKernel:
            __call__ = staticmethod(marked(kernel))
            step = staticmethod(marked(kernel.step))
            step_address = staticmethod(kernel.step_address)  # the decode loop's (marked below)

        inputs.decode_kernel = MarkedDecodeKernel()
    loop = getattr(runner.model, "decode_loop", None)  # every layer in one call
    if loop is not None:
        runs = loop.loop._runs  # one C entry per activation dtype
        for dtype, run in list(runs.items()):
            runs[dtype] = marked(run)
    for module in runner.model.modules():  # the few-row linear kernel (worker/cpu_linear.py)
        bound = getattr(module, "few_rows", None)
        if bound is not None:
            bound.function = marked(bound.function)


def _submit(engine, prompt: list[int], max_tokens: int, request_id: str) -> None:
    from yaied.core.request import SamplingParams
    from yaied.core.stream import EventStream

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    stream: EventStream[None] = EventStream()
    engine.add_request(prompt, params, sink=stream.sink(None), request_id=request_id)


if __name__ == "__main__":
    main()
