"""A step-level simulator: the real Scheduler over a real page pool and radix cache, with a cost
model in place of the model.

Each step the simulator asks ``Scheduler.schedule()`` for a batch exactly as the engine does,
advances its clock by the cost model's step time, and answers with a ``StepOutput`` whose sampled
tokens are random ids and whose ``model_time`` is that step time, so the queue policies see the
same inputs they see in the engine. Programs (``sim_workloads``) submit their calls stage by stage:
a call arrives when the previous stage has finished, under its program's session id.

    arrivals (heap) --add--> Scheduler --Batch--> cost model: now += a + b * tokens
        ^                                                        |
        +--- next stage of a program <-- finished calls <-- update(StepOutput)

Program-level token latency (response time / output tokens) is the figure of merit, as in
Autellix: it weighs a long program's latency by its length.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from yaied.cache.cache_manager import KVCacheManager
from yaied.cache.page_pool import PagePool
from yaied.core.config import SchedulerConfig
from yaied.core.request import Request, SamplingParams
from yaied.core.step import Batch, StepOutput
from yaied.engine.scheduler import Scheduler
from yaied.engine.sim_workloads import ProgramSpec


@dataclass(frozen=True, slots=True)
class CostModel:
    """Step time = overhead + per_token * tokens computed in the step."""

    overhead_s: float = 0.010
    per_token_s: float = 0.0001

    def step_time(self, batch: Batch) -> float:
        return self.overhead_s + self.per_token_s * batch.num_tokens


@dataclass(frozen=True, slots=True)
class EngineShape:
    """The simulated engine's capacity."""

    num_pages: int = 4096
    page_size: int = 16
    enable_prefix_caching: bool = True
    max_model_len: int = 1 << 20


@dataclass(slots=True)
class CallResult:
    request_id: str
    program_id: str
    arrival: float
    admitted: float  # first admission
    finish: float

    @property
    def waiting(self) -> float:
        return self.admitted - self.arrival


@dataclass(slots=True)
class ProgramResult:
    program_id: str
    kind: str
    arrival: float
    finish: float
    num_output_tokens: int

    @property
    def token_latency(self) -> float:
        return (self.finish - self.arrival) / self.num_output_tokens


@dataclass(slots=True)
class SimResult:
    programs: list[ProgramResult]
    calls: list[CallResult]
    num_steps: int
    num_preemptions: int
    num_prefix_hit_tokens: int
    end_time: float
    busy_time: float  # summed step times: end_time - busy_time is idle

    @property
    def utilization(self) -> float:
        return self.busy_time / self.end_time if self.end_time else 0.0


@dataclass(slots=True)
class _Program:
    spec: ProgramSpec
    stage: int = 0
    open_calls: int = 0
    context: list[int] = field(default_factory=list)
    first_call: Request | None = None  # the stage's first call: the next context


class Simulator:
    def __init__(
        self,
        config: SchedulerConfig,
        *,
        engine: EngineShape | None = None,
        cost: CostModel | None = None,
        seed: int = 0,
    ) -> None:
        engine = engine or EngineShape()
        self.cost = cost or CostModel()
        self.now = 0.0
        pool = PagePool(engine.num_pages, engine.page_size)
        cache = KVCacheManager(pool, enable_prefix_caching=engine.enable_prefix_caching)
        self.scheduler = Scheduler(config, cache, engine.max_model_len, clock=lambda: self.now)
        self.rng = random.Random(seed)
        self._arrivals: list[tuple[float, int, Request]] = []
        self._seq = 0
        self._programs: dict[str, _Program] = {}
        self._params: dict[int, SamplingParams] = {}

    def run(self, programs: Sequence[ProgramSpec], *, max_steps: int = 10_000_000) -> SimResult:
        """Run every program to completion."""
        calls: list[CallResult] = []
        finished: list[ProgramResult] = []
        for spec in programs:
            self._programs[spec.program_id] = _Program(spec)
            self._submit_stage(self._programs[spec.program_id], spec.arrival)
        steps, busy = 0, 0.0
        while self._arrivals or self.scheduler.has_work:
            self._release_arrivals()
            batch = self.scheduler.schedule()
            if batch is None:
                self._idle()
                continue
            step_time = self.cost.step_time(batch)
            self.now += step_time
            busy += step_time
            sampled = [self.rng.getrandbits(15) + 1 for _ in range(batch.num_sampled)]
            for request in self.scheduler.update(batch, StepOutput(sampled, model_time=step_time)):
                if request.is_finished:
                    calls.append(self._call_result(request))
                    finished += self._complete_call(request)
            steps += 1
            if steps >= max_steps:
                raise RuntimeError(f"simulation did not finish within {max_steps} steps")
        cache = self.scheduler.cache
        return SimResult(
            finished,
            calls,
            steps,
            self.scheduler.num_preemptions,
            cache.num_hit_tokens,
            self.now,
            busy,
        )

    def _idle(self) -> None:
        """Nothing could run: jump to the next arrival, or fail if nothing ever will."""
        if self.scheduler.waiting and not self.scheduler.running:
            request = self.scheduler.waiting[0]
            raise RuntimeError(
                f"call {request.request_id} ({request.num_tokens} tokens) never fits the "
                "simulated engine: give it more pages"
            )
        if self._arrivals:
            self.now = max(self.now, self._arrivals[0][0])

    def _release_arrivals(self) -> None:
        while self._arrivals and self._arrivals[0][0] <= self.now:
            self.scheduler.add(heapq.heappop(self._arrivals)[2])

    def _submit_stage(self, program: _Program, at: float) -> None:
        spec = program.spec
        program.first_call = None
        for index, call in enumerate(spec.stages[program.stage]):
            fresh = [self.rng.getrandbits(15) + 1 for _ in range(call.prompt_len)]
            request = Request(
                f"{spec.program_id}.{program.stage}.{index}",
                program.context + fresh,
                self._sampling(call.output_len),
                session_id=spec.program_id,
                arrival_time=at,
            )
            program.first_call = program.first_call or request
            heapq.heappush(self._arrivals, (at, self._seq, request))
            self._seq += 1
        program.open_calls = len(spec.stages[program.stage])

    def _complete_call(self, request: Request) -> list[ProgramResult]:
        """Account a finished call; start the program's next stage when this one is done.
        Returns the program's result when the call was its last."""
        program = self._programs[request.session_id or ""]
        program.open_calls -= 1
        if program.open_calls:
            return []
        spec = program.spec
        if spec.extend_context and program.first_call is not None:
            context = program.first_call.all_token_ids
            program.context = context if len(context) <= spec.max_context else []
        program.stage += 1
        if program.stage < len(spec.stages):
            self._submit_stage(program, self.now)
            return []
        del self._programs[spec.program_id]
        tokens = spec.num_output_tokens
        return [ProgramResult(spec.program_id, spec.kind, spec.arrival, self.now, tokens)]

    def _call_result(self, request: Request) -> CallResult:
        admitted = request.scheduled_time if request.scheduled_time is not None else self.now
        return CallResult(
            request.request_id, request.session_id or "", request.arrival_time, admitted, self.now
        )

    def _sampling(self, max_tokens: int) -> SamplingParams:
        params = self._params.get(max_tokens)
        if params is None:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            self._params[max_tokens] = params
        return params


@dataclass(frozen=True, slots=True)
class LatencyStats:
    mean: float
    p95: float
    p99: float

    def __str__(self) -> str:
        return f"mean={self.mean:.4f} p95={self.p95:.4f} p99={self.p99:.4f}"


def latency_stats(values: Sequence[float]) -> LatencyStats:
    """Mean and nearest-rank 95th / 99th percentiles."""
    if not values:
        raise ValueError("no values to summarise")
    ordered = sorted(values)

    def pct(p: float) -> float:
        return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]

    return LatencyStats(sum(ordered) / len(ordered), pct(95), pct(99))
