"""N-gram drafting and the scheduler's side of speculative decoding, without a model: which drafts
are proposed, how they ride in a step, and what update() keeps of them (pages, computed tokens,
stop conditions inside accepted drafts)."""

from __future__ import annotations

import pytest

from yaied.cache.cache_manager import KVCacheManager
from yaied.cache.page_pool import PagePool
from yaied.core.config import SchedulerConfig, SpeculativeConfig
from yaied.core.request import FinishReason, Request, RequestStatus, SamplingParams
from yaied.core.step import StepOutput
from yaied.engine.scheduler import Scheduler
from yaied.engine.speculative import NgramProposer, ngram_drafts

SPEC = SpeculativeConfig(speculative_method="ngram", num_speculative_tokens=3)


@pytest.mark.parametrize(
    ("tokens", "k", "expected"),
    [
        ([1, 2, 3, 4, 5, 9, 1, 2, 3], 3, [4, 5, 9]),  # the longest suffix, 1 2 3, occurred
        ([1, 2, 3, 4, 5, 9, 2, 3], 2, [4, 5]),  # only the 2-gram 2 3 did
        ([1, 2, 3, 4, 5, 9, 7, 3], 3, []),  # below prompt_lookup_min
        ([7, 1, 2, 8, 1, 2, 9, 1, 2], 3, [9, 1, 2]),  # the most recent occurrence wins
        ([5, 5, 5, 5], 3, [5]),  # what follows runs into the suffix itself
        ([1, 2], 3, []),
        ([9, 1, 2, 3, 4, 0, 0, 2, 3], 1, [4]),
    ],
)
def test_ngram_drafts(tokens, k, expected):
    assert ngram_drafts(tokens, k, 2, 4) == expected


def test_ngram_drafts_ignore_matches_across_token_boundaries():
    # As int32 bytes, 256 = 00 01 00 00 and 1 = 01 00 00 00: the suffix [1, 0] = 01 00 00 00 00
    # 00 00 00 sits inside [256, 0, 0] one byte off, which must not count as an occurrence.
    assert ngram_drafts([256, 0, 0, 5, 1, 0], 2, 2, 2) == []
    assert ngram_drafts([256, 0, 1, 0, 6, 1, 0], 2, 2, 2) == [6, 1]


def make(num_pages=64, page_size=4, budget=32, spec=SPEC, max_len=1024):
    pool = PagePool(num_pages, page_size)
    cache = KVCacheManager(pool, enable_prefix_caching=True)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget)
    return Scheduler(config, cache, max_len, speculative=spec), pool


def copying_request(rid: str = "a", max_tokens: int = 32, **params) -> Request:
    """A prompt whose last two tokens occurred before: 10 11 12 13 14 15 16 10 11."""
    prompt = [10, 11, 12, 13, 14, 15, 16, 10, 11]
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **params)
    return Request(rid, prompt, sampling)


def prefill(scheduler: Scheduler, request: Request, first_token: int = 12) -> None:
    scheduler.add(request)
    batch = scheduler.schedule()
    assert batch.seqs[0].num_draft_tokens == 0  # a prefill carries no drafts
    scheduler.update(batch, StepOutput([first_token]))


def test_a_decode_carries_drafts_and_keeps_the_accepted_ones():
    scheduler, pool = make()
    request = copying_request()
    prefill(scheduler, request)  # output [12]: the suffix 11 12 occurred, 13 14 15 follow
    batch = scheduler.schedule()
    (seq,) = batch.seqs
    assert seq.token_ids == [12, 13, 14, 15] and seq.num_draft_tokens == 3
    assert seq.start_pos == 9 and batch.num_tokens == 4
    assert len(request.page_ids) == pool.pages_for(13)
    # The model agreed with 13 and 14, then sampled 99 instead of 15.
    scheduler.update(batch, StepOutput([99], num_accepted_drafts=[1 + 1]))
    assert request.output_token_ids == [12, 13, 14, 99]
    assert request.num_computed_tokens == 12  # positions 0..11; 99 is not computed yet
    assert len(request.page_ids) == pool.pages_for(13)
    assert scheduler.spec.stats() == {
        "spec_decode_num_drafts": 1,
        "spec_decode_num_draft_tokens": 3,
        "spec_decode_num_accepted_tokens": 2,
    }


def test_rejected_drafts_give_their_pages_back():
    scheduler, pool = make(page_size=2)
    request = copying_request()
    prefill(scheduler, request)
    batch = scheduler.schedule()
    assert len(request.page_ids) == pool.pages_for(13)  # 7 pages, for positions up to 12
    scheduler.update(batch, StepOutput([50], num_accepted_drafts=[0]))
    assert request.output_token_ids == [12, 50]
    assert request.num_computed_tokens == 10
    assert len(request.page_ids) == pool.pages_for(11)  # 6: the draft-only page is free again
    assert pool.num_free + len(request.page_ids) == pool.num_pages


@pytest.mark.parametrize(
    ("params", "accepted", "output", "reason"),
    [
        # max_tokens caps the drafts themselves: 3 outputs allowed, 1 there, so 1 draft.
        (dict(max_tokens=3), 1, [12, 13, 77], FinishReason.LENGTH),
        # A stop token among the accepted drafts ends the output there.
        (dict(stop_token_ids=(14,)), 3, [12, 13, 14], FinishReason.STOP),
    ],
)
def test_a_stop_inside_the_accepted_drafts_ends_the_output_there(params, accepted, output, reason):
    scheduler, pool = make()
    request = copying_request(**params)
    prefill(scheduler, request)
    batch = scheduler.schedule()
    num_drafts = batch.seqs[0].num_draft_tokens
    scheduler.update(batch, StepOutput([77], num_accepted_drafts=[min(accepted, num_drafts)]))
    assert request.output_token_ids == output
    assert request.finish_reason is reason and request.status is RequestStatus.FINISHED
    assert pool.num_free + scheduler.cache.tree.num_evictable_pages == pool.num_pages


def test_finish_drops_the_tokens_after_a_stop_string():
    scheduler, _ = make()
    request = copying_request()
    prefill(scheduler, request)
    batch = scheduler.schedule()
    scheduler.update(batch, StepOutput([16], num_accepted_drafts=[3]))
    assert request.output_token_ids == [12, 13, 14, 15, 16]
    scheduler.finish(request, FinishReason.STOP, 2)  # the stop string ended at 14
    assert request.output_token_ids == [12, 13, 14]
    assert request.status is RequestStatus.FINISHED


def test_drafts_respect_budget_context_and_batch_size():
    proposer = NgramProposer(SPEC, max_model_len=1024)
    request = copying_request()
    request.output_token_ids.append(12)
    assert proposer.drafts(request, budget=100) == [13, 14, 15]
    assert proposer.drafts(request, budget=3) == [13, 14]  # the last token takes one
    assert NgramProposer(SPEC, max_model_len=12).drafts(request, 100) == [13]
    limited = SpeculativeConfig(speculative_method="ngram", speculative_max_batch_size=4)
    assert NgramProposer(limited, 1024).active(4) and not NgramProposer(limited, 1024).active(5)


def test_drafts_stop_at_what_the_grammar_refuses():
    class OnlyBelow14:
        error = None
        is_terminated = False

        def accept(self, token_id: int) -> bool:
            return token_id < 14

        def num_acceptable(self, token_ids) -> int:
            return next((i for i, t in enumerate(token_ids) if t >= 14), len(token_ids))

    request = copying_request()
    request.output_token_ids.append(12)
    request.grammar = OnlyBelow14()
    assert NgramProposer(SPEC, 1024).drafts(request, budget=100) == [13]


def test_drafts_never_preempt():
    scheduler, pool = make(num_pages=4, page_size=4)  # 16 slots
    a = copying_request()
    b = Request("b", [1, 2, 3], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    scheduler.add(a)
    scheduler.add(b)
    batch = scheduler.schedule()  # both prefill: a takes 3 pages, b the last one
    scheduler.update(batch, StepOutput([12, 5]))
    assert pool.num_free == 0
    batch = scheduler.schedule()  # a's drafts would need a fifth page: it decodes plainly
    assert [(s.request_id, s.num_draft_tokens) for s in batch.seqs] == [("a", 0), ("b", 0)]
    assert scheduler.num_preemptions == 0


def test_off_by_default():
    scheduler, _ = make(spec=None)
    request = copying_request()
    prefill(scheduler, request)
    assert scheduler.schedule().seqs[0].num_draft_tokens == 0
    assert scheduler.proposer is None
