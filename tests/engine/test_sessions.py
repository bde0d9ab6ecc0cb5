"""The session table: attained service (sum, and the ATLAS max for parallel calls), waiting and
running totals, idle expiry."""

from __future__ import annotations

import pytest

from yaied.engine.sessions import CallStats, SessionTable


def call(table: SessionTable, session: str, now: float) -> CallStats:
    return CallStats(session, table.arrive(session, now), since=now)


def test_sequential_calls_sum_their_model_time():
    table = SessionTable(idle_expiry_s=100)
    first = call(table, "s", 0.0)
    first.model_time = 2.0
    table.complete(first, 5.0)
    second = call(table, "s", 5.0)
    assert second.inherited == 2.0  # a call inherits its session's service on arrival
    second.model_time = 3.0
    table.complete(second, 9.0)
    stats = table.get("s")
    assert stats is not None and stats.service == 5.0 and stats.num_calls == 2


def test_parallel_calls_keep_the_longest_path():
    table = SessionTable(idle_expiry_s=100)
    seed = call(table, "s", 0.0)
    seed.model_time = 1.0
    table.complete(seed, 1.0)
    # A wave of three parallel calls: each inherits 1.0; service becomes 1 + the longest.
    wave = [call(table, "s", 1.0) for _ in range(3)]
    for c, t in zip(wave, (0.5, 2.0, 1.5), strict=True):
        c.model_time = t
    for c in wave:
        table.complete(c, 4.0)
    stats = table.get("s")
    assert stats is not None and stats.service == 3.0
    assert stats.num_active == 0


def test_waiting_and_running_intervals_are_summed():
    table = SessionTable(idle_expiry_s=100)
    c = call(table, "s", 0.0)
    c.switch(2.0, running=True)  # queued 0..2
    c.switch(5.0, running=False)  # ran 2..5, preempted
    assert c.waited(6.0) == 3.0 and c.ran(6.0) == 3.0
    c.switch(7.0, running=True)  # queued 5..7
    table.complete(c, 8.0)  # ran 7..8
    stats = table.get("s")
    assert stats is not None and (stats.waiting, stats.running) == (4.0, 4.0)


def test_idle_sessions_expire_but_active_ones_stay():
    table = SessionTable(idle_expiry_s=10)
    done = call(table, "idle", 0.0)
    done.model_time = 1.0
    table.complete(done, 1.0)
    call(table, "busy", 0.0)  # never completes: still in flight
    table.expire(5.0)
    assert table.get("idle") is not None  # idle for 4 s only
    table.expire(20.0)
    assert table.get("idle") is None and table.get("busy") is not None
    assert call(table, "idle", 21.0).inherited == 0.0  # back as a new program


def test_arrivals_sweep_expired_sessions():
    table = SessionTable(idle_expiry_s=10)
    for i in range(5):
        table.complete(call(table, f"s{i}", 0.0), 0.0)
    assert len(table) == 5
    call(table, "late", 100.0)
    assert len(table) == 1


def test_bad_expiry_is_rejected():
    with pytest.raises(ValueError, match="expiry"):
        SessionTable(idle_expiry_s=0)
