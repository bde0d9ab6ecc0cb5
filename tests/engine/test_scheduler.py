"""The scheduler over a page pool: budgets, chunking, admission, preemption and page accounting."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from yaied.cache.cache_manager import KVCacheManager
from yaied.cache.page_pool import PagePool
from yaied.core.config import SchedulerConfig
from yaied.core.request import FinishReason, Request, RequestStatus, SamplingParams
from yaied.core.step import StepOutput
from yaied.engine.scheduler import Scheduler


def make(num_pages=64, page_size=4, budget=32, max_seqs=8, max_len=1024, caching=False):
    pool = PagePool(num_pages, page_size)
    config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget)
    cache = KVCacheManager(pool, enable_prefix_caching=caching)
    return Scheduler(config, cache, max_len), pool


def request(rid: str, prompt_len: int, max_tokens: int = 4) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Request(rid, list(range(1, prompt_len + 1)), params)


def step(scheduler: Scheduler, token: int = 7):
    batch = scheduler.schedule()
    if batch is None:
        return None, []
    sampled = [token] * batch.num_sampled
    return batch, scheduler.update(batch, StepOutput(sampled))


def test_long_prompt_is_chunked_and_decodes_come_first():
    scheduler, _ = make(budget=16)
    scheduler.add(request("a", 40))
    sizes = []
    while True:
        batch, _ = step(scheduler)
        sizes.append([len(s.token_ids) for s in batch.seqs])
        if scheduler.requests["a"].output_token_ids:
            break
    assert sizes == [[16], [16], [8]]
    scheduler.add(request("b", 40))
    batch, _ = step(scheduler)
    # a's decode rides first, b's chunk takes the rest of the budget
    assert [(s.request_id, len(s.token_ids)) for s in batch.seqs] == [("a", 1), ("b", 15)]


def test_max_num_seqs_limits_running():
    scheduler, _ = make(max_seqs=2, budget=100)
    for i in range(4):
        scheduler.add(request(str(i), 5))
    batch, _ = step(scheduler)
    assert [s.request_id for s in batch.seqs] == ["0", "1"]
    assert len(scheduler.waiting) == 2


def test_finish_by_length_frees_pages():
    scheduler, pool = make()
    scheduler.add(request("a", 10, max_tokens=3))
    finished = []
    while scheduler.has_work:
        _, got = step(scheduler)
        finished += [r for r in got if r.is_finished]
    assert finished[0].finish_reason is FinishReason.LENGTH
    assert finished[0].output_token_ids == [7, 7, 7]
    assert pool.num_free == pool.num_pages


def test_admission_waits_for_pages_fcfs():
    scheduler, pool = make(num_pages=4, page_size=4, budget=64)
    scheduler.add(request("big", 12))  # 3 pages
    scheduler.add(request("next", 8))  # 2 pages: must wait, FCFS
    scheduler.add(request("small", 1))  # would fit, but may not overtake
    batch, _ = step(scheduler)
    assert [s.request_id for s in batch.seqs] == ["big"]


def test_preemption_recomputes_newest_and_keeps_output():
    scheduler, pool = make(num_pages=4, page_size=4, budget=64)
    scheduler.add(request("old", 7, max_tokens=8))  # 2 pages
    scheduler.add(request("new", 7, max_tokens=8))  # 2 pages
    step(scheduler)  # both prefilled: 8 tokens each -> every page in use after the first decode
    preempted = False
    while scheduler.has_work:
        step(scheduler)
        new = scheduler.requests.get("new")
        if new is not None and new.status is RequestStatus.WAITING and new.output_token_ids:
            preempted = True
    assert preempted and scheduler.num_preemptions >= 1
    assert pool.num_free == pool.num_pages


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(st.integers(1, 40), min_size=1, max_size=10),
    max_tokens=st.integers(1, 12),
    num_pages=st.integers(11, 30),
    budget=st.integers(1, 48),
    aborts=st.lists(st.integers(0, 9), max_size=4),
)
def test_random_workloads_finish_and_return_every_page(
    prompts, max_tokens, num_pages, budget, aborts
):
    scheduler, pool = make(
        num_pages=num_pages, page_size=4, budget=budget, max_seqs=4, max_len=num_pages * 4
    )
    for i, n in enumerate(prompts):
        scheduler.add(request(str(i), n, max_tokens))
    steps = 0
    while scheduler.has_work:
        if steps in aborts and scheduler.running:
            scheduler.finish(scheduler.running[0], FinishReason.ABORT)
        _, got = step(scheduler)
        held = sum(len(r.page_ids) for r in scheduler.running)
        assert held + pool.num_free == pool.num_pages
        for r in scheduler.running:
            assert len(r.page_ids) * 4 >= r.num_computed_tokens
        steps += 1
        assert steps < 2000
    assert pool.num_free == pool.num_pages


def run_to_end(scheduler):
    while scheduler.has_work:
        step(scheduler)


def test_a_later_request_starts_from_the_cached_prefix():
    scheduler, pool = make(page_size=4, budget=64, caching=True)
    prefix = list(range(1, 13))  # three full pages
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    scheduler.add(Request("a", prefix + [50, 51], params))
    run_to_end(scheduler)
    b = Request("b", prefix + [60, 61, 62], params)
    scheduler.add(b)
    batch, _ = step(scheduler)
    assert b.num_cached_tokens == 12
    assert [(s.start_pos, len(s.token_ids)) for s in batch.seqs] == [(12, 3)]
    run_to_end(scheduler)
    assert scheduler.cache.num_queried_tokens == 14 + 15 and scheduler.cache.num_hit_tokens == 12


def test_chunks_of_a_running_prefill_are_shared_at_once():
    scheduler, _ = make(page_size=4, budget=8, caching=True)
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    long = Request("long", list(range(1, 30)), params)
    scheduler.add(long)
    step(scheduler)  # first chunk: tokens 0..7, two full pages, cached right away
    twin = Request("twin", list(range(1, 9)) + [99], params)
    scheduler.add(twin)
    while twin.status is RequestStatus.WAITING:
        step(scheduler)
    assert not long.is_finished  # its pages were cached while it still runs
    assert twin.num_cached_tokens == 8


def test_a_prefix_being_prefilled_is_waited_for_not_computed_twice():
    scheduler, _ = make(page_size=4, budget=12, caching=True)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prefix = list(range(1, 17))  # four full pages
    first = Request("first", prefix + [50], params)
    scheduler.add(first)
    step(scheduler)  # its first chunk: 12 tokens, three pages cached
    second = Request("second", prefix + [60], params)
    stranger = Request("stranger", [90, 91, 92], params)
    scheduler.add(second)
    scheduler.add(stranger)
    batch, _ = step(scheduler)  # first computes its fourth page; second would compute it too
    assert second.status is RequestStatus.WAITING and not second.page_ids
    assert stranger.status is RequestStatus.RUNNING  # sharing nothing, it does not wait
    assert {s.request_id for s in batch.seqs} == {"first", "stranger"}
    step(scheduler)
    assert second.status is RequestStatus.RUNNING and second.num_cached_tokens == 16
    run_to_end(scheduler)
    assert scheduler.cache.num_hit_tokens == 16


def test_disabled_cache_never_hits():
    scheduler, _ = make(page_size=4, budget=64, caching=False)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for name in "ab":
        scheduler.add(Request(name, list(range(1, 20)), params))
        run_to_end(scheduler)
    assert scheduler.cache.num_hit_tokens == 0 and scheduler.cache.tree.num_cached_pages == 0


def test_preempted_request_resumes_from_its_cached_pages():
    scheduler, pool = make(num_pages=6, page_size=4, budget=64, caching=True)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    scheduler.add(Request("old", list(range(1, 9)), params))
    scheduler.add(Request("new", list(range(20, 28)), params))
    resumed_from = None
    while scheduler.has_work:
        new = scheduler.requests.get("new")
        was_waiting = new is not None and new.status is RequestStatus.WAITING
        step(scheduler)
        if was_waiting and new.output_token_ids and new.status is RequestStatus.RUNNING:
            resumed_from = resumed_from or new.num_cached_tokens
    assert scheduler.num_preemptions >= 1
    assert resumed_from and resumed_from >= 8  # its prompt pages came back from the cache
    assert pool.num_free + scheduler.cache.tree.num_cached_pages == pool.num_pages


def test_prompts_that_do_not_fit_together_are_not_prefilled_over_and_over():
    """Two waiting long prompts while a running call's decodes hold most of the pool: each
    fits alone, not together. Admitting one for its first chunk only to run out of pages
    part-way preempted it, and through the cache's eviction the other's work too, every few
    steps: about 27x the prefill work. A prompt now starts once the pool holds its rest."""
    scheduler, pool = make(num_pages=512, page_size=16, budget=512, max_len=8192, caching=True)
    specs = [(6000, 1000), (5000, 16), (7000, 200)]
    for i, (prompt_len, max_tokens) in enumerate(specs):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        scheduler.add(Request(str(i), [i * 10_000 + t for t in range(prompt_len)], params))
    computed = 0
    while scheduler.has_work:
        batch, _ = step(scheduler)
        computed += batch.num_tokens
    needed = sum(prompt_len + max_tokens - 1 for prompt_len, max_tokens in specs)
    assert computed <= needed * 1.1
    assert pool.num_free + scheduler.cache.tree.num_cached_pages == pool.num_pages


def test_a_request_that_preempts_itself_is_not_overtaken_by_the_queue():
    """A running request whose pages are taken by a growing decode (or that preempts itself,
    nobody else being left) re-queues at the front; the waiting request behind it must not take
    the pages it just gave back in the same step. It used to: two long prompts that did not
    fit beside a long decode took turns, each step evicting the other's cached chunks and
    computing one of its own again, so every step's prefill was wasted until the decode ended
    (2040- and 780-token prompts over HTTP: one preemption a step, minutes without a finish)."""
    scheduler, pool = make(num_pages=16, page_size=4, budget=8, caching=True)

    def tokens(start: int, n: int) -> list[int]:
        return list(range(start, start + n))

    def add(rid: str, prompt: list[int], max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        scheduler.add(Request(rid, prompt, params))

    add("decode", tokens(1000, 24), max_tokens=12)  # 6 pages, then 9: a cannot keep its 8
    while not scheduler.requests["decode"].output_token_ids:
        step(scheduler)
    add("a", tokens(2000, 32), max_tokens=2)  # 8 pages: room for all of it when it starts
    add("b", tokens(3000, 16), max_tokens=2)  # 4 pages
    a, b = scheduler.requests["a"], scheduler.requests["b"]
    overtaken = 0
    while "decode" in scheduler.requests:
        b_waited = b.status is RequestStatus.WAITING
        step(scheduler)
        # a is ahead of b in the queue whenever both wait (a preempted one goes to the front).
        now_b, now_a = b.status, a.status
        overtaken += b_waited and now_b is RequestStatus.RUNNING and now_a is RequestStatus.WAITING
    assert scheduler.num_preemptions >= 1  # the decode's growth did take a's pages
    assert not overtaken, "b overtook a, which was ahead of it in the queue"
    while scheduler.has_work:
        step(scheduler)
    assert pool.num_free + scheduler.cache.tree.num_evictable_pages == pool.num_pages
