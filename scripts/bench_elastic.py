"""`bench_router.py --elastic`: the autoscaler against fixed pools, on fake engines whose step is a
sleep (a 2-core box cannot show the capacity of real engines, three of them least of all).

Each fake engine runs ``--slots`` calls at once, one token per call every ``--step-ms``, and
takes ``--load-seconds`` to come up (a model loading). Calls of ``--tokens`` tokens arrive as a
Poisson process whose rate ramps: ``--low-rate`` for the first phase, ``--high-rate`` for the
second (above one engine's capacity), ``--low-rate`` again for the third. The same arrivals (one
seed) hit a pool of 1 engine, a pool of ``--max-engines``, and an elastic pool (1 to
``--max-engines``, the autoscaler with short windows).

Reported per pool: calls, failed calls, TTFT p50 and p99, engine-seconds (what the pool cost),
scaling events; for the elastic pool, the reaction time: from the start of the high phase to
the autoscaler's first decision and to the new engine taking calls.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

from yaied.core.model_info import ModelInfo
from yaied.core.request import FinishReason, SamplingParams, TokenEvent
from yaied.engine.inputs import InputProcessor
from yaied.router.autoscale import AutoscaleConfig, Autoscaler
from yaied.router.config import RouterConfig
from yaied.router.handle import CallSink, EngineHandle, Health
from yaied.router.manager import EngineManager


class SleepEngine(EngineHandle):
    """Continuous batching in miniature: up to ``slots`` calls, one token each per step."""

    kind = "local"

    def __init__(self, engine_id: str, slots: int, step: float, load: float) -> None:
        super().__init__(engine_id)
        self.slots, self.step, self.load = slots, step, load
        self.info = ModelInfo(8192, 256)
        self.queue: deque[tuple[str, int, CallSink]] = deque()
        self.running: dict[str, list] = {}  # id -> [tokens left, sink, tokens sent]
        self._loop_task: asyncio.Task | None = None

    async def start(self) -> None:
        await asyncio.sleep(self.load)
        self._loop_task = asyncio.get_running_loop().create_task(self._steps())
        self.health = Health.UP

    async def stop(self, timeout: float = 15.0) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        for request_id, (_, sink, _) in list(self.running.items()):
            sink.deliver(TokenEvent(request_id, [], "", FinishReason.ABORT))
        for request_id, _, sink in self.queue:
            sink.deliver(TokenEvent(request_id, [], "", FinishReason.ABORT))
        self.health = Health.STOPPED

    def submit(self, request_id, prompt_ids, params, *, session_id, priority, sink) -> None:
        self.queue.append((request_id, params.max_tokens, sink))

    async def abort(self, request_id: str) -> None:
        pass

    def stats(self):
        return {"num_requests_waiting": len(self.queue), "num_requests_running": len(self.running)}

    async def _steps(self) -> None:
        while True:
            while self.queue and len(self.running) < self.slots:
                request_id, tokens, sink = self.queue.popleft()
                self.running[request_id] = [tokens, sink, 0]
            await asyncio.sleep(self.step)
            for request_id, call in list(self.running.items()):
                call[0] -= 1
                call[2] += 1
                done = call[0] == 0
                reason = FinishReason.LENGTH if done else None
                call[1].deliver(
                    TokenEvent(
                        request_id, [1], "x", reason, num_prompt_tokens=1, num_output_tokens=call[2]
                    )  # fmt: skip
                )
                if done:
                    del self.running[request_id]


@dataclass
class Result:
    pool: str
    ttft: list[float] = field(default_factory=list)
    failed: int = 0
    engine_seconds: float = 0.0
    events: dict[str, int] = field(default_factory=dict)
    first_decision_s: float | None = None
    first_new_engine_up_s: float | None = None
    last_scale_down_after_high_s: float | None = None

    def summary(self) -> dict:
        ttft = np.array(self.ttft) if self.ttft else np.zeros(1)
        return {
            "pool": self.pool,
            "calls": len(self.ttft) + self.failed,
            "failed": self.failed,
            "ttft_p50_s": round(float(np.percentile(ttft, 50)), 3),
            "ttft_p99_s": round(float(np.percentile(ttft, 99)), 3),
            "engine_seconds": round(self.engine_seconds, 1),
            "scale_events": self.events,
            "reaction_decision_s": self.first_decision_s,
            "reaction_engine_up_s": self.first_new_engine_up_s,
            "scale_down_after_high_s": self.last_scale_down_after_high_s,
        }


def arrivals(args: argparse.Namespace) -> list[float]:
    """Arrival times (seconds from the start), the ramp low -> high -> low."""
    rng = random.Random(args.seed)
    phases = [float(p) for p in args.phases.split(",")]
    rates = [args.low_rate, args.high_rate, args.low_rate]
    times, start = [], 0.0
    for length, rate in zip(phases, rates, strict=True):
        t = start + rng.expovariate(rate)
        while t < start + length:
            times.append(t)
            t += rng.expovariate(rate)
        start += length
    return times


async def run_pool(name: str, engines: int, elastic: bool, args: argparse.Namespace) -> Result:
    manager = EngineManager(RouterConfig())
    counter = [0]

    def new_engine() -> SleepEngine:
        engine_id = str(manager._next_id)
        return SleepEngine(engine_id, args.slots, args.step_ms / 1000, args.load_seconds)

    for _ in range(engines):
        manager.add_engine(new_engine())
    manager.inputs = InputProcessor(None, SimpleNamespace(eos_token_id=None), ModelInfo(8192, 256))
    await manager.start()
    result = Result(name)
    phases = [float(p) for p in args.phases.split(",")]
    high_start, high_end = phases[0], phases[0] + phases[1]
    started = time.monotonic()
    scaler = None
    if elastic:
        config = AutoscaleConfig(
            enabled=True,
            min_engines=1,
            max_engines=args.max_engines,
            scale_up_waiting_per_engine=args.threshold,
            scale_up_window_seconds=args.window,
            scale_down_idle_seconds=args.idle,
            cooldown_seconds=args.cooldown,
            interval_seconds=0.25,
        )
        scaler = Autoscaler(manager, config, new_engine=new_engine)
        manager.autoscaler = scaler
        scaler.start()

    async def watch() -> None:
        """Engine-seconds, and when scaling happened."""
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.05)
            now = time.monotonic()
            alive = sum(manager.engine_state(i) != "removed" for i in manager.handles)
            result.engine_seconds += alive * (now - last)
            last = now
            t = now - started
            if scaler is None:
                continue
            if result.first_decision_s is None and scaler.events["up"]:
                result.first_decision_s = round(t - high_start, 2)
            new_up = [i for i, e in manager.pool.items() if e.origin == "autoscale"]
            if result.first_new_engine_up_s is None and any(
                manager.engine_state(i) == "up" for i in new_up
            ):
                result.first_new_engine_up_s = round(t - high_start, 2)
            if scaler.events["down"] > counter[0]:
                counter[0] = scaler.events["down"]
                result.last_scale_down_after_high_s = round(t - high_end, 2)

    async def call(at: float) -> None:
        await asyncio.sleep(max(0.0, started + at - time.monotonic()))
        sent = time.monotonic()
        params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
        handle = await manager.submit_request(prompt=[1, 2, 3], sampling_params=params)
        first = None
        async for event in handle:
            if first is None and event.token_ids:
                first = time.monotonic() - sent
            if event.finished and event.finish_reason is not FinishReason.LENGTH:
                result.failed += 1
                return
        result.ttft.append(first)

    watcher = asyncio.create_task(watch())
    await asyncio.gather(*(call(at) for at in arrivals(args)))
    await asyncio.sleep(max(0.0, started + sum(phases) - time.monotonic()))
    watcher.cancel()
    result.events = manager.autoscale_events() if scaler else {"up": 0, "down": 0}
    await manager.stop()
    return result


def run(args: argparse.Namespace) -> int:
    capacity = args.slots / (args.tokens * args.step_ms / 1000)
    results = []
    pools = [("fixed-1", 1, False), (f"fixed-{args.max_engines}", args.max_engines, False)]
    pools.append((f"elastic-1..{args.max_engines}", 1, True))
    for name, engines, elastic in pools:
        summary = asyncio.run(run_pool(name, engines, elastic, args)).summary()
        results.append(summary)
        print(json.dumps(summary), flush=True)
    say = lambda line: print(line, file=sys.stderr)  # noqa: E731
    say(
        f"\nelastic: phases {args.phases} s at {args.low_rate}/{args.high_rate}/{args.low_rate} "
        f"calls/s, {args.tokens} tokens each; one engine serves {capacity:.1f} calls/s"
    )
    say(f"{'pool':<14}{'calls':>6}{'failed':>7}{'TTFT p50':>9}{'p99':>8}{'eng-s':>7}  events")
    for s in results:
        say(
            f"{s['pool']:<14}{s['calls']:>6}{s['failed']:>7}{s['ttft_p50_s']:>8.2f}s"
            f"{s['ttft_p99_s']:>7.2f}s{s['engine_seconds']:>7.0f}  {s['scale_events']}"
        )
    elastic = results[-1]
    say(
        f"reaction: decision {elastic['reaction_decision_s']} s, new engine up "
        f"{elastic['reaction_engine_up_s']} s after the ramp; last scale-down "
        f"{elastic['scale_down_after_high_s']} s after it"
    )
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("--elastic")
    group.add_argument("--phases", default="10,20,30", help="low,high,low phase seconds")
    group.add_argument("--low-rate", type=float, default=2.0, help="calls/s in the low phases")
    group.add_argument("--high-rate", type=float, default=25.0, help="calls/s in the high phase")
    group.add_argument("--tokens", type=int, default=20, help="output tokens per call")
    group.add_argument("--slots", type=int, default=4, help="calls a fake engine runs at once")
    group.add_argument("--step-ms", type=float, default=20.0, help="a fake engine's step")
    group.add_argument("--load-seconds", type=float, default=1.0, help="a new engine's start")
    group.add_argument("--max-engines", type=int, default=4)
    group.add_argument("--threshold", type=float, default=2.0, help="waiting calls per engine")
    group.add_argument("--window", type=float, default=2.0, help="scale-up window, seconds")
    group.add_argument("--idle", type=float, default=3.0, help="scale-down idle, seconds")
    group.add_argument("--cooldown", type=float, default=3.0, help="seconds between events")
