"""schedule_ahead (yaied/engine/lookahead.py): the next decode step while the one before it runs,
over a page pool without a model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.engine.test_scheduler import make, request, step
from yaied.core.config import load_config
from yaied.core.request import FinishReason
from yaied.core.step import StepOutput
from yaied.engine.lookahead import overlaps, schedule_ahead


def _in_flight(scheduler, *requests):
    """Prefill the requests (one step, applied), then schedule their first decode: the batch
    in flight, not applied."""
    for r in requests:
        scheduler.add(r)
    step(scheduler)
    return scheduler.schedule()


def test_schedule_ahead_decodes_each_request_one_position_on_with_its_token_from_the_device():
    scheduler, _ = make(page_size=4)
    batch = _in_flight(scheduler, request("a", 7, max_tokens=5), request("b", 3))
    ahead = schedule_ahead(scheduler, batch)
    assert [(s.request_id, s.start_pos, s.num_output_tokens) for s in ahead.seqs] == [
        ("a", 8, 2),
        ("b", 4, 2),
    ]
    assert ahead.previous_rows == [0, 1] and ahead.num_tokens == 2
    # pages for the position ahead are reserved now: a's 9th token opens its third page
    assert len(scheduler.requests["a"].page_ids) == 3
    # the step in flight is applied, then the one ahead, like any two steps
    scheduler.update(batch, StepOutput([5, 6]))
    scheduler.update(ahead, StepOutput([8, 9]))
    assert scheduler.requests["a"].output_token_ids == [7, 5, 8]
    assert scheduler.requests["a"].num_computed_tokens == 9


def test_schedule_ahead_leaves_out_a_request_the_step_in_flight_ends():
    scheduler, _ = make()
    batch = _in_flight(scheduler, request("a", 5, max_tokens=2), request("b", 5))
    ahead = schedule_ahead(scheduler, batch)
    assert [s.request_id for s in ahead.seqs] == ["b"] and ahead.previous_rows == [1]


def test_schedule_ahead_declines_where_the_next_step_needs_the_host():
    def declined(**params) -> bool:
        scheduler, _ = make()
        r = request("a", 5, max_tokens=8)
        for name, value in params.items():
            object.__setattr__(r.params, name, value)
        return schedule_ahead(scheduler, _in_flight(scheduler, r)) is None

    assert not declined()
    assert declined(repetition_penalty=1.2)  # its penalties read the output on the host
    assert declined(min_tokens=4)  # EOS banned until then: the ban needs the output's length
    assert declined(logprobs=2)  # read on the host at launch: the launch would wait
    scheduler, _ = make(max_seqs=1)
    batch = _in_flight(scheduler, request("a", 5, max_tokens=8), request("b", 5))
    assert schedule_ahead(scheduler, batch) is None  # b waits: the next step must admit it
    scheduler, _ = make(budget=8)
    scheduler.add(request("a", 20))
    assert schedule_ahead(scheduler, scheduler.schedule()) is None  # a chunk that samples not


def test_schedule_ahead_never_preempts():
    scheduler, _ = make(num_pages=3, page_size=4)
    batch = _in_flight(scheduler, request("a", 3, max_tokens=8), request("b", 3))
    # each decodes position 3 of its one page and needs a second for position 4: one is free
    assert schedule_ahead(scheduler, batch) is None
    assert scheduler.num_preemptions == 0 and len(scheduler.running) == 2


def test_schedule_ahead_skips_a_request_that_ended_and_goes_on_with_the_rest():
    """A request the step before ended (an EOS, say) still has a row in the step in flight;
    the step after that leaves it out instead of giving up the overlap."""
    scheduler, _ = make()
    batch = _in_flight(scheduler, request("a", 5, max_tokens=9), request("b", 5, max_tokens=9))
    ahead = schedule_ahead(scheduler, batch)
    assert [s.request_id for s in ahead.seqs] == ["a", "b"]
    scheduler.update(batch, StepOutput([5, 6]))
    scheduler.finish(scheduler.requests["a"], FinishReason.STOP)  # its token was a stop
    again = schedule_ahead(scheduler, ahead)
    assert [s.request_id for s in again.seqs] == ["b"] and again.previous_rows == [1]
    scheduler.update(ahead, StepOutput([8, 9]))  # a's wasted row is skipped
    assert scheduler.requests["b"].output_token_ids == [7, 6, 9]
    scheduler.finish(scheduler.requests["b"], FinishReason.STOP)
    assert schedule_ahead(scheduler, again) is None  # nothing left running


@pytest.mark.parametrize(
    ("mode", "parallel", "method", "said"),
    [
        ("on", object(), "", "tensor parallelism"),
        ("on", None, "ngram", "speculative decoding"),
        ("auto", object(), "ngram", None),  # not asked for by name: nothing to explain
        ("on", None, "", None),  # on, as asked
    ],
)
def test_overlap_steps_on_that_cannot_apply_says_so_once(caplog, mode, parallel, method, said):
    """`--overlap-steps on` with tensor parallelism or speculative decoding was off without a
    word (documented, but nothing in the log told the operator who asked for it)."""
    config = load_config(env={}, overrides={"overlap_steps": mode, "speculative_method": method})
    worker = SimpleNamespace(device=torch.device("cpu"), parallel=parallel)
    with caplog.at_level("INFO", logger="yaied.engine.lookahead"):
        on = overlaps(config, worker)
    lines = [r.getMessage() for r in caplog.records]
    assert on is (said is None and mode == "on")
    if said is None:
        assert lines == []
    else:
        assert len(lines) == 1 and "overlap_steps = on" in lines[0] and said in lines[0], lines
        assert caplog.records[0].levelname == "WARNING"
