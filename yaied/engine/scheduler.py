"""The scheduler: which requests run in the next step, and how many of their tokens.

One rule drives prefill and decode alike: a running request's computed tokens catch up with its
total tokens (prompt + output). A decode is a request one token behind; a prefill chunk is a request
many tokens behind, cut to the step's token budget. When a step reaches a request's last token,
the worker samples the next one.

Each step walks the running and waiting requests in the queue policy's order (``policy.py``; under
the default fcfs: decodes of running requests first, then their unfinished prefills, then waiting
requests in arrival order) while the token budget, the running-request limit and free pages allow
(cached pages nobody uses count as free; they are evicted on demand). A waiting request first takes
the longest cached prefix of its tokens and prefills only the rest; it starts only when the pages
for all of that rest are free, not just its first chunk's (admission.py); one that cannot get them
stops admission (no overtaking), unless the policy lets it preempt running requests of a worse
rank, and then nobody behind it is admitted in that step. One exception: a waiting request
whose prompt shares more full pages with a running request that is still prefilling them than the
cache holds yet waits for that prefill instead of computing the same pages again (as SGLang does
for prefixes shared within a batch); requests behind it that share nothing are admitted meanwhile.
A running request that cannot get a page preempts the worst-ranked (then smallest, then newest)
running request not yet in the step (recompute: its pages go to the prefix cache, and it
re-queues at the front with its output kept); no waiting request is admitted in that step, since
it would overtake the preempted one with its pages.

With speculative decoding on (yaied/engine/speculative.py), a decode may carry draft tokens after
its last token, when pages for them are free (drafts never preempt anyone); update() then appends
the drafts the worker accepted plus its sampled token, stopping at the first stop condition, and
rolls num_computed_tokens back to the verified tokens, freeing the pages of the rejected ones.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from yaied.cache.cache_manager import KVCacheManager
from yaied.core.config import EngineConfig, SchedulerConfig, SpeculativeConfig
from yaied.core.request import FinishReason, Request, RequestStatus
from yaied.core.step import Batch, ScheduledSeq, StepOutput
from yaied.engine.admission import preemptible_by, room_for_rest
from yaied.engine.policy import QueuePolicy, Rank, make_policy
from yaied.engine.speculative import NgramProposer, SpecCounters
from yaied.engine.stops import stop_reason

# `_admit`'s answer for a request that waits for a prefix another request is prefilling: unlike
# 0 (no seat, no pages) it does not stop admission of the requests behind it.
_DEFERRED = -1


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        cache: KVCacheManager,
        max_model_len: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        self.config = config
        self.cache = cache
        self.pool = cache.pool
        self.max_model_len = max_model_len
        self.clock = clock  # a simulator passes its own
        self.policy: QueuePolicy = make_policy(config)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.proposer = (
            NgramProposer(speculative, max_model_len)
            if speculative is not None and speculative.enabled
            else None
        )
        self.spec = SpecCounters()

    @classmethod
    def for_engine(
        cls, config: EngineConfig, cache: KVCacheManager, max_model_len: int
    ) -> Scheduler:
        return cls(config.scheduler, cache, max_model_len, speculative=config.speculative)

    def counters(self) -> dict[str, int]:
        """The scheduler's counters for the engine's stats()."""
        return {"num_preemptions": self.num_preemptions, **self.spec.stats()}

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)
        self.policy.on_add(request, self.clock())

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch | None:
        budget = self.config.max_num_batched_tokens
        decodes: list[ScheduledSeq] = []
        prefills: list[ScheduledSeq] = []
        ranks = self._ranks()
        scheduled: set[str] = set()
        admitting = True
        speculating = self.proposer is not None and self.proposer.active(len(self.running))
        for request, was_running in self._walk(ranks):
            if budget == 0:
                break
            if was_running:
                if request.status is not RequestStatus.RUNNING:
                    continue  # preempted earlier in this pass
                n = min(request.num_tokens - request.num_computed_tokens, budget)
                drafts = self._drafts(request, budget) if speculating and n == 1 else []
                preempted = self.num_preemptions
                reserved = self._reserve_pages(request, n, scheduled, ranks)
                if self.num_preemptions != preempted:  # the preempted wait at the queue's front:
                    admitting = False  # admitting others now would overtake them with their pages
                if not reserved:
                    continue  # the request preempted itself
                if drafts:
                    prefills.append(self._slice(request, 1, drafts))  # a multi-token chunk
                    scheduled.add(request.request_id)
                    budget -= 1 + len(drafts)
                    continue
            else:
                preempted = self.num_preemptions  # a waiting request's victims wait too:
                n = self._admit(request, budget, scheduled, ranks) if admitting else 0
                admitting = admitting and self.num_preemptions == preempted  # none overtakes them
                if n == _DEFERRED:
                    continue
                if n == 0:
                    admitting = False  # no overtaking in rank order when seats or pages are short
                    continue
            (decodes if n == 1 else prefills).append(self._slice(request, n))
            scheduled.add(request.request_id)
            budget -= n
        seqs = decodes + prefills
        if not seqs:
            return None
        return Batch(seqs, self.config.max_num_batched_tokens - budget)

    def _drafts(self, request: Request, budget: int) -> list[int]:
        """A decode's draft tokens, with pages for them when free ones allow (a draft never
        preempts anyone); [] otherwise."""
        assert self.proposer is not None
        drafts = self.proposer.drafts(request, budget)
        if drafts and not self.cache.reserve(request, 1 + len(drafts)):
            return []
        return drafts

    def _ranks(self) -> dict[str, Rank]:
        now = self.clock()
        rank = self.policy.rank
        return {rid: rank(r, now) for rid, r in self.requests.items()}

    def _walk(self, ranks: dict[str, Rank]) -> list[tuple[Request, bool]]:
        """Every request in serving order: by rank, then running decodes, running prefills and
        waiting requests; queue order within each (Python's sort is stable)."""

        def phase(request: Request) -> int:
            return 0 if request.num_tokens - request.num_computed_tokens == 1 else 1

        order = sorted(self.running, key=phase) + list(self.waiting)
        if self.policy.reorders:
            order.sort(key=lambda r: ranks[r.request_id])
        return [(r, r.status is RequestStatus.RUNNING) for r in order]

    def _admit(
        self, request: Request, budget: int, scheduled: set[str], ranks: dict[str, Rank]
    ) -> int:
        """Move a waiting request to running with pages for its first chunk; returns the chunk's
        size, 0 when there is no seat or no pages for it, _DEFERRED when it waits for a running
        request's prefill of their shared prefix."""
        if len(self.running) >= self.config.max_num_seqs:
            return 0
        # Prefill only what the prefix cache lacks. Prompt logprobs need every prompt position
        # computed, so those requests skip the lookup until their prompt has been scored (a
        # preempted one that already has output resumes from the cache like any other).
        # Mean pooling (an embedding) needs every prompt row too.
        params = request.params
        every_row = params.prompt_logprobs is not None or params.pooling == "mean"
        scores_prompt = every_row and not request.output_token_ids
        self.cache.match_prefix(request, lookup=not scores_prompt)
        if not scores_prompt and self._prefix_being_prefilled(request):
            self._unmatch(request)
            return _DEFERRED
        n = min(request.num_tokens - request.num_computed_tokens, budget)
        if not room_for_rest(self, request, scheduled, ranks) or not self._reserve_pages(
            request, n, scheduled, ranks
        ):
            self._unmatch(request)
            return 0
        self.cache.count_prefix_hit(request)
        now = self.clock()
        if request.scheduled_time is None:
            request.scheduled_time = now
        self.waiting.remove(request)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self.policy.on_admit(request, now)
        return n

    def _prefix_being_prefilled(self, request: Request) -> bool:
        """Whether a running request is still prefilling full pages of `request`'s prompt that
        the cache does not hold yet: then waiting a few steps gets them from the cache instead of
        computing them twice. Running requests always advance, so the wait ends."""
        if not self.cache.enabled:
            return False
        size = self.pool.page_size
        tokens = request.all_token_ids
        cached = request.num_computed_tokens
        for other in self.running:
            done = other.num_computed_tokens
            if done >= other.num_prompt_tokens:
                continue  # prefilled: whatever it shares is cached (or was evicted) already
            theirs = other.all_token_ids
            if tokens[:size] != theirs[:size]:
                continue  # the common case: not even the first page in common
            limit = min(len(tokens) - 1, other.num_prompt_tokens) // size
            shared = 1
            while shared < limit and (
                tokens[shared * size : (shared + 1) * size]
                == theirs[shared * size : (shared + 1) * size]
            ):
                shared += 1
            shared_tokens = min(shared, limit) * size
            if shared_tokens > cached and done < shared_tokens:
                return True
        return False

    def _slice(self, request: Request, n: int, drafts: list[int] | None = None) -> ScheduledSeq:
        start = request.num_computed_tokens
        tokens = request.all_token_ids[start : start + n] if n > 1 else [request.token_at(start)]
        if drafts:
            tokens += drafts
        params, output = request.params, request.output_token_ids
        seq = ScheduledSeq(
            request_id=request.request_id,
            token_ids=tokens,
            start_pos=start,
            # By reference, as are the penalty histories below: nothing changes them between
            # schedule() and update() (the engine task waits for the worker in between, and aborts
            # queue until the next schedule), and the worker only reads them.
            page_ids=request.page_ids,
            sample=start + n == request.num_tokens,
            params=params,
            num_output_tokens=len(output),
            num_draft_tokens=len(drafts or ()),
        )
        if seq.sample and params.has_penalties:
            seq.penalty_output_ids = output
            if params.repetition_penalty != 1.0:
                seq.penalty_prompt_ids = request.prompt_token_ids
        if seq.sample and len(output) < params.min_tokens:
            banned = request.eos_token_ids.union(params.stop_token_ids)
            seq.banned_token_ids = tuple(sorted(banned))
        # Once output exists the prompt was scored already: a recompute does not score it again.
        if params.prompt_logprobs is not None and not output:
            seq.prompt_logprob_targets = request.prompt_token_ids[start + 1 : start + n + 1]
        return seq

    def _reserve_pages(
        self, request: Request, n: int, scheduled: set[str], ranks: dict[str, Rank]
    ) -> bool:
        """Give the request pages for its next n tokens, preempting running requests not yet in
        this step while pages are short: the worst-ranked first (see _victim_key for ties). A
        running request may preempt any of them, itself included (then it returns False); a
        waiting one only those ranked strictly worse, and only under a preemptive policy."""
        waiting = request.status is RequestStatus.WAITING
        while not self.cache.reserve(request, n):
            if waiting and not self.policy.preemptive:
                return False
            candidates = [r for r in reversed(self.running) if r.request_id not in scheduled]
            if waiting:  # room_for_rest found that preempting all of these makes room
                candidates = preemptible_by(self, request, scheduled, ranks)
            victim = max(candidates, key=lambda r: self._victim_key(r, ranks), default=None)
            if victim is None:
                return False
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def _victim_key(self, request: Request, ranks: dict[str, Rank]) -> tuple:
        """Preempt the largest key. fcfs ranks every call alike and keeps vLLM's rule (the
        newest, first among the candidates). A reordering policy takes, among its worst-ranked,
        the call holding the fewest pages, the least to recompute: under plas the worst-ranked
        are often long calls near their end, and recomputing those over and over left programs
        waiting for minutes at overload (ReAct at 1 program/s in the simulator: p99 7.5 -> 3.2)."""
        if not self.policy.reorders:
            return ()
        return (ranks[request.request_id], -len(request.page_ids))

    def _unmatch(self, request: Request) -> None:
        """Undo match_prefix for a request that could not be admitted after all."""
        self.cache.release(request, keep=False)
        request.num_computed_tokens = 0
        request.num_cached_tokens = 0

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: the request's computed pages go to the prefix cache, so when it
        is re-admitted it resumes from them (unless they were evicted meanwhile)."""
        self.running.remove(request)
        self.cache.release(request, keep=True)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        self.num_preemptions += 1
        self.policy.on_preempt(request, self.clock())

    def update(self, batch: Batch, output: StepOutput) -> list[Request]:
        """Apply a step's results. Returns the requests that received a token, in batch order;
        those that finished (EOS, stop token, length, a terminated grammar, or ERROR for a token
        the grammar refused) are already released."""
        sampled = iter(output.sampled_token_ids)
        accepted = iter(output.num_accepted_drafts or ())  # aligned with sampled when present
        got_token: list[Request] = []
        now = self.clock()
        for seq in batch.seqs:
            request = self.requests.get(seq.request_id)
            token = next(sampled) if seq.sample else None
            num_accepted = next(accepted, 0) if seq.sample else 0
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            # Service is the model time of the steps a call ran in, each counted in full: a
            # batch runs its calls in parallel, and a share by tokens would make prompt-heavy
            # calls look long on hardware where a step costs about the same whatever its size.
            self.policy.on_step(request, output.model_time)
            if seq.num_draft_tokens:
                assert token is not None
                self._append_verified(request, seq, num_accepted, token)
                if request.first_token_time is None:
                    request.first_token_time = now
                got_token.append(request)
                continue
            request.num_computed_tokens = seq.start_pos + len(seq.token_ids)
            if len(seq.token_ids) > 1:
                self.cache.cache(request)  # a prefill chunk's pages serve other requests at once
            if token is None:
                continue
            request.output_token_ids.append(token)
            if request.first_token_time is None:
                request.first_token_time = now
            reason = stop_reason(request, token, self.max_model_len)
            if reason is not None:
                self.finish(request, reason)
            got_token.append(request)
        return got_token

    def _append_verified(
        self, request: Request, seq: ScheduledSeq, num_accepted: int, token: int
    ) -> None:
        """A speculative decode's result: the accepted drafts, then the sampled token, each
        through the stop checks (whatever follows a stop is dropped). Every appended token but
        the last has its K/V computed now; the rejected drafts' slots are given back."""
        drafts = seq.token_ids[len(seq.token_ids) - seq.num_draft_tokens :]
        self.spec.count(seq.num_draft_tokens, num_accepted)
        reason = None
        for new in [*drafts[:num_accepted], token]:
            request.output_token_ids.append(new)
            reason = stop_reason(request, new, self.max_model_len)
            if reason is not None:
                break
        request.num_computed_tokens = request.num_tokens - 1
        self.cache.trim(request)
        if reason is not None:
            self.finish(request, reason)

    def finish(self, request: Request, reason: FinishReason, num_dropped_tokens: int = 0) -> None:
        """End a request (any reason) and give back its pages. Idempotent. num_dropped_tokens:
        output tokens to drop from the end first (accepted drafts after a stop string)."""
        if num_dropped_tokens:
            del request.output_token_ids[-num_dropped_tokens:]
            request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
        if request.status is RequestStatus.FINISHED:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        # A failed step may have left this request's K/V incomplete: don't cache it then.
        self.cache.release(request, keep=reason is not FinishReason.ERROR)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self.requests[request.request_id]
        self.policy.on_finish(request, self.clock())
