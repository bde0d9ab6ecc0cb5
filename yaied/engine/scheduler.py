"""The scheduler: which requests run in the next step, and how many of their tokens.

One rule drives prefill and decode alike: a running request's computed tokens catch up with its
total tokens (prompt + output). A decode is a request one token behind; a prefill chunk is a request
many tokens behind, cut to the step's token budget. When a step reaches a request's last token,
the worker samples the next one.

Each step: decodes of running requests first (latency), then the unfinished prefills of running
requests, then waiting requests in arrival order while the token budget, the running-request limit
and free pages allow. A running request that cannot get a page preempts the newest running request
(recompute: its pages are freed and it re-queues at the front with its output kept).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from yaied.cache.page_pool import PagePool
from yaied.config import SchedulerConfig
from yaied.request import FinishReason, Request, RequestStatus, SamplingParams


@dataclass(slots=True)
class ScheduledSeq:
    """One request's share of a step, copied out so the worker never reads a live Request."""

    request_id: str
    token_ids: list[int]  # the tokens computed this step, at positions start_pos, start_pos + 1...
    start_pos: int
    page_ids: list[int]  # the request's page table, covering every position up to the chunk's end
    sample: bool  # the chunk ends at the request's last token: sample the next one
    params: SamplingParams


@dataclass(slots=True)
class Batch:
    seqs: list[ScheduledSeq]  # single-token sequences first, then multi-token prefill chunks
    num_tokens: int

    @property
    def num_sampled(self) -> int:
        return sum(seq.sample for seq in self.seqs)


@dataclass(slots=True)
class StepOutput:
    """The worker's answer: one sampled token per sampling sequence, in batch order."""

    sampled_token_ids: list[int]
    error: str | None = None
    model_time: float = 0.0


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: PagePool, max_model_len: int) -> None:
        self.config = config
        self.pool = pool
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch | None:
        budget = self.config.max_num_batched_tokens
        decodes: list[ScheduledSeq] = []
        prefills: list[ScheduledSeq] = []
        # Decodes first, then unfinished prefills; each may preempt newer running requests.
        behind_by_one = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        behind_more = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        scheduled: set[str] = set()
        for request in behind_by_one + behind_more:
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this pass
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._reserve_pages(request, n, scheduled):
                continue  # the request preempted itself
            (decodes if n == 1 else prefills).append(self._slice(request, n))
            scheduled.add(request.request_id)
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._reserve_pages(request, n, None):
                break  # first come, first served: no overtaking when pages are short
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            (decodes if n == 1 else prefills).append(self._slice(request, n))
            budget -= n
        seqs = decodes + prefills
        if not seqs:
            return None
        return Batch(seqs, self.config.max_num_batched_tokens - budget)

    def _slice(self, request: Request, n: int) -> ScheduledSeq:
        start = request.num_computed_tokens
        tokens = request.all_token_ids[start : start + n] if n > 1 else [request.token_at(start)]
        return ScheduledSeq(
            request_id=request.request_id,
            token_ids=tokens,
            start_pos=start,
            page_ids=list(request.page_ids),
            sample=start + n == request.num_tokens,
            params=request.params,
        )

    def _reserve_pages(self, request: Request, n: int, scheduled: set[str] | None) -> bool:
        """Give the request pages for its next n tokens. A running request (``scheduled`` is the
        set of ids already in this step) may preempt the newest running request not yet in the
        step, else itself; a waiting one (``scheduled`` None) only waits."""
        need = self.pool.pages_for(request.num_computed_tokens + n) - len(request.page_ids)
        while need > self.pool.num_free:
            if scheduled is None:
                return False
            victim = next(
                (r for r in reversed(self.running) if r.request_id not in scheduled), request
            )
            self._preempt(victim)
            if victim is request:
                return False
        if need > 0:
            request.page_ids.extend(self.pool.allocate(need))
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.pool.free(request.page_ids)
        request.page_ids = []
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def update(self, batch: Batch, output: StepOutput) -> list[Request]:
        """Apply a step's results. Returns the requests that received a token, in batch order;
        those that finished (EOS, stop token, length) are already released."""
        sampled = iter(output.sampled_token_ids)
        got_token: list[Request] = []
        now = time.monotonic()
        for seq in batch.seqs:
            request = self.requests.get(seq.request_id)
            token = next(sampled) if seq.sample else None
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            request.num_computed_tokens = seq.start_pos + len(seq.token_ids)
            if token is None:
                continue
            request.output_token_ids.append(token)
            request.first_token_time = request.first_token_time or now
            reason = self._stop_reason(request, token)
            if reason is not None:
                self.finish(request, reason)
            got_token.append(request)
        return got_token

    def _stop_reason(self, request: Request, token: int) -> FinishReason | None:
        if token in request.eos_token_ids or token in request.params.stop_token_ids:
            return FinishReason.STOP
        if len(request.output_token_ids) >= request.params.max_tokens:
            return FinishReason.LENGTH
        if request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def finish(self, request: Request, reason: FinishReason) -> None:
        """End a request (any reason) and give back its pages. Idempotent."""
        if request.status is RequestStatus.FINISHED:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.pool.free(request.page_ids)
        request.page_ids = []
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self.requests[request.request_id]
