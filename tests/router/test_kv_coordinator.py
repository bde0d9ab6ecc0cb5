"""The KV coordinator: where sessions' contexts live, hit rates, pins dropped with their engine."""

from __future__ import annotations

from yaied.router.kv_coordinator import KVCoordinator


def test_hit_rates_per_engine_and_per_session():
    kv = KVCoordinator()
    kv.record("s1", "0", 100, 0, 10)
    kv.record("s1", "0", 200, 100, 10)
    kv.record("s2", "1", 100, 50)
    kv.record(None, "1", 100, 0)
    assert kv.engine_hit_rate("0") == 100 / 300
    assert kv.engine_hit_rate("1") == 50 / 200
    assert kv.session_hit_rate("s1") == 100 / 300
    assert kv.engines_with("s1") == {"0": 210}
    assert kv.totals().hit_rate == 150 / 500
    assert kv.engine_hit_rate("9") == 0.0 and kv.session_hit_rate("nope") == 0.0


def test_losing_an_engine_clears_its_pins_and_contexts():
    kv = KVCoordinator()
    kv.set_pin("s1", "0")
    kv.set_pin("s2", "1")
    kv.record("s1", "0", 10, 0)
    assert kv.engine_lost("0") == 1
    assert kv.pin_of("s1") is None and kv.pin_of("s2") == "1"
    assert kv.engines_with("s1") == {}


def test_sessions_are_bounded_least_recently_used_first():
    kv = KVCoordinator(max_sessions=2)
    kv.set_pin("a", "0")
    kv.set_pin("b", "0")
    kv.pin_of("a")  # reads do not refresh; writes do
    kv.set_pin("a", "1")
    kv.set_pin("c", "0")
    assert kv.num_sessions == 2 and kv.pin_of("b") is None and kv.pin_of("a") == "1"
