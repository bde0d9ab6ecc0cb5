"""The call lifecycle: legal moves, timestamps, queries, illegal moves, bounded memory."""

from __future__ import annotations

import pytest

from yaied.router.lifecycle import CallState, IllegalTransition, LifecycleTracker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_pending_running_completed_with_waiting_and_service_time(clock):
    tracker = LifecycleTracker(clock=clock)
    record = tracker.add("a", "s1", 10)
    assert record.state is CallState.PENDING and record.waiting_time is None
    clock.now = 101.5
    tracker.transition("a", CallState.RUNNING, engine_id="1")
    clock.now = 104.0
    tracker.transition("a", CallState.COMPLETED, num_output_tokens=7)
    assert (record.state, record.engine_id, record.num_output_tokens) == (
        CallState.COMPLETED,
        "1",
        7,
    )
    assert record.waiting_time == 1.5 and record.service_time == 2.5


@pytest.mark.parametrize("end", [CallState.CANCELLED, CallState.FAILED])
def test_a_pending_call_may_be_cancelled_or_fail(clock, end):
    tracker = LifecycleTracker(clock=clock)
    tracker.add("a", None, 1)
    record = tracker.transition("a", end, error="x" if end is CallState.FAILED else None)
    assert record.state is end and record.service_time is None


@pytest.mark.parametrize(
    ("path", "illegal"),
    [
        ([], CallState.COMPLETED),  # pending cannot complete without running
        ([], CallState.PENDING),
        ([CallState.RUNNING], CallState.RUNNING),
        ([CallState.RUNNING], CallState.PENDING),
        ([CallState.RUNNING, CallState.COMPLETED], CallState.RUNNING),
        ([CallState.RUNNING, CallState.COMPLETED], CallState.CANCELLED),
        ([CallState.CANCELLED], CallState.RUNNING),
        ([CallState.FAILED], CallState.COMPLETED),
    ],
)
def test_illegal_transitions_raise(clock, path, illegal):
    tracker = LifecycleTracker(clock=clock)
    tracker.add("a", None, 1)
    for state in path:
        tracker.transition("a", state)
    before = tracker.get("a").state
    with pytest.raises(IllegalTransition):
        tracker.transition("a", illegal)
    assert tracker.get("a").state is before  # nothing changed


def test_unknown_ids_and_duplicates(clock):
    tracker = LifecycleTracker(clock=clock)
    with pytest.raises(IllegalTransition, match="unknown"):
        tracker.transition("nope", CallState.RUNNING)
    tracker.add("a", None, 1)
    with pytest.raises(ValueError, match="already in use"):
        tracker.add("a", None, 1)


def test_queries_by_state_and_by_session(clock):
    tracker = LifecycleTracker(clock=clock)
    for name, session in [("a", "s1"), ("b", "s1"), ("c", "s2"), ("d", None)]:
        tracker.add(name, session, 1)
    tracker.transition("a", CallState.RUNNING)
    tracker.transition("b", CallState.CANCELLED)
    tracker.transition("c", CallState.RUNNING)
    tracker.transition("c", CallState.COMPLETED)
    ids = lambda records: sorted(r.request_id for r in records)  # noqa: E731
    assert ids(tracker.by_state(CallState.PENDING)) == ["d"]
    assert ids(tracker.by_state(CallState.RUNNING)) == ["a"]
    assert ids(tracker.by_state(CallState.CANCELLED)) == ["b"]
    assert ids(tracker.by_state(CallState.COMPLETED)) == ["c"]
    assert ids(tracker.by_session("s1")) == ["a", "b"]
    assert ids(tracker.by_session("s2")) == ["c"]


def test_queries_by_client_id_match_exactly(clock):
    tracker = LifecycleTracker(clock=clock)
    tracker.add("k1-0", None, 1, client_id="foo")
    clock.now += 1
    tracker.add("k1-1", None, 1, client_id="foo")
    tracker.add("k2", None, 1, client_id="foo-3")
    tracker.add("k3", None, 1)  # no client id: its own
    tracker.transition("k1-0", CallState.CANCELLED)
    assert [r.request_id for r in tracker.by_client_id("foo")] == ["k1-0", "k1-1"]
    assert [r.request_id for r in tracker.by_client_id("foo-3")] == ["k2"]
    assert tracker.by_client_id("fo") == [] and tracker.by_client_id("k1") == []
    assert tracker.get("k3").client_id == "k3"


def test_finished_records_expire_by_age_and_by_count(clock):
    tracker = LifecycleTracker(ttl_seconds=10, max_finished=3, clock=clock)
    for i in range(5):
        tracker.add(str(i), None, 1)
        tracker.transition(str(i), CallState.FAILED)
    assert len(tracker) == 3 and tracker.get("0") is None and tracker.get("4") is not None
    tracker.add("live", None, 1)
    clock.now += 11
    tracker.expire()
    assert len(tracker) == 1  # live calls never expire
    assert tracker.get("live").state is CallState.PENDING


def test_an_id_can_be_reused_after_its_call_ended(clock):
    tracker = LifecycleTracker(clock=clock)
    tracker.add("a", None, 1)
    tracker.transition("a", CallState.CANCELLED)
    assert tracker.add("a", None, 2).state is CallState.PENDING


def test_a_move_is_recorded_and_keeps_the_state(clock):
    tracker = LifecycleTracker(clock=clock)
    record = tracker.add("a", None, 10)
    tracker.transition("a", CallState.RUNNING, engine_id="0")
    clock.now = 102.0
    tracker.record_move("a", "0", "1", 12)
    assert record.state is CallState.RUNNING and record.engine_id == "1"
    assert [(m.from_engine, m.to_engine, m.num_sent_tokens, m.at) for m in record.moves] == [
        ("0", "1", 12, 102.0)
    ]
    tracker.transition("a", CallState.COMPLETED)
    with pytest.raises(IllegalTransition, match="not live"):
        tracker.record_move("a", "1", "2", 20)  # an ended call never moves
