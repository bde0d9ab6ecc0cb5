"""Queue policies: the Autellix toy example, priority order, anti-starvation, preemption by rank."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from yaied.cache.cache_manager import KVCacheManager
from yaied.cache.page_pool import PagePool
from yaied.core.config import SchedulerConfig, load_config
from yaied.core.request import Request, RequestStatus, SamplingParams
from yaied.core.step import StepOutput
from yaied.engine.async_engine import AsyncEngine
from yaied.engine.policy import POLICIES, MultiLevelPolicy, make_policy, queue_bounds, queue_level
from yaied.engine.scheduler import Scheduler
from yaied.engine.sim_workloads import CallSpec, ProgramSpec
from yaied.engine.simulator import CostModel, EngineShape, Simulator

# One step costs one time unit; a call of n units prompts 1 token and outputs n.
UNIT = CostModel(overhead_s=1.0, per_token_s=0.0)
ONE_AT_A_TIME = SchedulerConfig(
    max_num_seqs=1, max_num_batched_tokens=16, base_quantum_s=1.0, quantum_growth=2.0
)


def sequential(name: str, arrival: float, units: list[int]) -> ProgramSpec:
    stages = tuple((CallSpec(1, n),) for n in units)
    return ProgramSpec(name, "toy", arrival, stages, extend_context=False)


@pytest.mark.parametrize(
    ("policy", "waiting", "b_done"), [("fcfs", 7, 8), ("mlfq", 7, 8), ("plas", 4, 5)]
)
def test_autellix_toy_example(policy, waiting, b_done):
    """One call at a time, never interrupted; the scheduler picks at each completion. A: three
    calls of 3 units from t=0; B: two calls of 1 unit from t=1. PLAS lets the program that has
    received less service (B) go first at t=4, when FCFS and MLFQ run A2 ahead of B2."""
    config = dataclasses.replace(ONE_AT_A_TIME, policy=policy)
    sim = Simulator(config, engine=EngineShape(num_pages=64, page_size=4), cost=UNIT)
    result = sim.run([sequential("A", 0.0, [3, 3, 3]), sequential("B", 1.0, [1, 1])])
    finish = {p.program_id: p.finish for p in result.programs}
    assert sum(c.waiting for c in result.calls) == waiting
    assert finish == {"A": 11.0, "B": float(b_done)}
    assert result.num_preemptions == 0


def test_queue_levels_grow_geometrically():
    bounds = queue_bounds(4, 1.0, 2.0)
    assert bounds == [1.0, 3.0, 7.0]
    assert [queue_level(s, bounds) for s in (0.0, 0.99, 1.0, 2.9, 3.0, 7.0, 1e9)] == [
        0,
        0,
        1,
        1,
        2,
        3,
        3,
    ]
    assert queue_bounds(1, 1.0, 2.0) == []  # a single queue: everyone is level 0


def make(policy: str, *, num_pages: int = 64, max_seqs: int = 8, **knobs) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_seqs, max_num_batched_tokens=64, policy=policy, **knobs
    )
    cache = KVCacheManager(PagePool(num_pages, 4), enable_prefix_caching=True)
    return Scheduler(config, cache, 4096, clock=lambda: 0.0)


def req(rid: str, prompt: int, max_tokens: int = 4, **kwargs) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = 100 * (1 + sum(map(ord, rid)))  # distinct tokens: no accidental prefix hits
    return Request(rid, list(range(start, start + prompt)), params, arrival_time=0.0, **kwargs)


def test_priority_admits_lower_values_first():
    scheduler = make("priority", max_seqs=2)
    for rid, priority in (("late", 5), ("urgent", -1), ("normal", 0), ("normal2", 0)):
        scheduler.add(req(rid, 4, priority=priority))
    batch = scheduler.schedule()
    assert batch is not None
    assert [s.request_id for s in batch.seqs] == ["urgent", "normal"]


def test_fcfs_ignores_priority():
    scheduler = make("fcfs", max_seqs=2)
    for rid, priority in (("late", 5), ("urgent", -1), ("normal", 0)):
        scheduler.add(req(rid, 4, priority=priority))
    batch = scheduler.schedule()
    assert batch is not None and [s.request_id for s in batch.seqs] == ["late", "urgent"]


def test_unknown_policy_is_rejected():
    with pytest.raises(ValueError, match="scheduler.policy"):
        SchedulerConfig(policy="lifo")
    with pytest.raises(ValueError, match="quantum_growth"):
        SchedulerConfig(policy="plas", quantum_growth=0.5)
    assert make_policy(SchedulerConfig(policy="mlfq")).name == "mlfq"


def run_step(scheduler: Scheduler, model_time: float = 1.0) -> list[str]:
    batch = scheduler.schedule()
    assert batch is not None
    scheduler.update(batch, StepOutput([7] * batch.num_sampled, model_time=model_time))
    return [s.request_id for s in batch.seqs]


def test_plas_preempts_a_lower_queue_call_when_pages_run_out():
    # 8 pages of 4 tokens. "hog" (a program with service already) holds 6 pages; a new
    # program's call needs 4: under plas it takes them. Hog's pages go to the radix cache, and
    # only the 3 that "new" lacks beyond the free one are evicted: old's page, then hog's tail.
    scheduler = make("plas", num_pages=8, base_quantum_s=1.0)
    old = req("old", 4, max_tokens=1, session_id="long")
    scheduler.add(old)
    run_step(scheduler, model_time=5.0)  # the long program's first call: 5 s of service
    hog = req("hog", 24, max_tokens=4, session_id="long")
    scheduler.add(hog)
    run_step(scheduler)
    assert hog.status is RequestStatus.RUNNING and len(hog.page_ids) == 6
    new = req("new", 14, max_tokens=2, session_id="short")
    scheduler.add(new)
    assert "new" in run_step(scheduler)
    assert hog.status is RequestStatus.WAITING and scheduler.num_preemptions == 1
    assert scheduler.cache.tree.num_cached_pages == 4 + 3  # hog's first 4 pages, new's 3
    while scheduler.has_work:
        run_step(scheduler)
    assert hog.num_cached_tokens == 16  # it resumed from its cached prefix


def test_fcfs_never_preempts_for_a_waiting_call():
    scheduler = make("fcfs", num_pages=8)
    hog = req("hog", 24, max_tokens=20)
    scheduler.add(hog)
    run_step(scheduler)
    scheduler.add(req("new", 14, max_tokens=2))
    assert run_step(scheduler) == ["hog"]
    assert scheduler.num_preemptions == 0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_anti_starvation_promotes_a_starving_call():
    config = SchedulerConfig(policy="plas", base_quantum_s=1.0, starvation_beta=2.0)
    policy = make_policy(config)
    assert isinstance(policy, MultiLevelPolicy)
    # The long program ran 10 s without waiting: its service puts its next call low.
    first = req("l0", 4, session_id="long")
    policy.on_add(first, 0.0)
    policy.on_admit(first, 0.0)
    policy.on_step(first, 10.0)
    policy.on_finish(first, 10.0)
    call = req("l1", 4, session_id="long")
    call.arrival_time = 10.0
    policy.on_add(call, 10.0)
    low = policy.rank(call, 10.0)
    assert low > (0,)
    # Waiting 2 x the 10 s it ran is the limit at beta = 2: then it jumps to the top queue.
    assert policy.rank(call, 29.0) == low
    assert policy.rank(call, 30.0) == (0,)


async def generate_all(policy: str, folder, prompts) -> tuple[list[list[int]], int]:
    """Greedy tokens of one prompt alone, then of all prompts submitted at once (two to a
    session, mixed priorities); and the number of preemptions."""
    # Tiny llama: 2 layers x 2 kv heads x 16 dims x 2 x 4 bytes = 512 B a token, 8 KiB a page;
    # 20 pages cannot hold six 60..80-token requests at once, so some get preempted.
    config = load_config(
        overrides={
            "model": str(folder),
            "dtype": "float32",
            "kv_cache_gib": 20 * 8192 / 2**30,
            "max_model_len": 128,
            "max_num_batched_tokens": 32,
            "policy": policy,
            "base_quantum_s": 1e-4,  # tiny steps: let queues and preemption come into play
        }
    )
    engine = AsyncEngine(config, show_progress=False)

    async def one(i: int, prompt: list[int]) -> list[int]:
        stream = engine.generate(
            prompt,
            session_id=f"s{i // 2}",
            priority=i % 3,
            max_tokens=24,
            temperature=0.0,
            ignore_eos=True,
        )
        return [t async for event in stream for t in event.token_ids]

    try:
        alone = await one(0, prompts[0])
        together = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        return [alone, *together], engine.scheduler.num_preemptions
    finally:
        await engine.shutdown()


@pytest.mark.slow  # every policy over the same batch: 15 s or more
@pytest.mark.timeout(120)
async def test_every_policy_gives_the_same_tokens(tiny_model_dirs):
    prompts = [[(7 * i + j) % 250 + 1 for j in range(60 + 4 * i)] for i in range(6)]
    outputs = {p: await generate_all(p, tiny_model_dirs["llama"], prompts) for p in POLICIES}
    tokens, preemptions = outputs["fcfs"]
    assert len(tokens[0]) == 24 and tokens[0] == tokens[1]  # alone = inside the batch
    for policy, (other, preempted) in outputs.items():
        assert other == tokens, policy
        assert preempted > 0, policy
