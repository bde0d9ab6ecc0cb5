"""One table of engine metric names (core/metric_names.py): what a daemon exports, a router over
it as a remote engine reads back and exports again, every counter included."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from yaied.core.metric_names import ENGINE_COUNTERS, ENGINE_GAUGES, restarts_key
from yaied.router.remote_metrics import stats_from_metrics
from yaied.server.metrics import ServerMetrics


def engine_stats(base: int) -> dict[str, int | float]:
    """An engine's stats() with a distinct value for every counter and a restart."""
    stats: dict[str, int | float] = {
        key: base + i for i, key in enumerate(ENGINE_COUNTERS, start=1)
    }
    stats |= {"num_requests_running": 2, "num_requests_waiting": 1}
    stats |= {"num_free_pages": 30, "num_pages": 40, restarts_key("cache_error"): base + 100}
    return stats


def samples(text: bytes) -> dict[tuple[str, str], float]:
    """(sample name, reason label) -> value, over the one engine a metrics text holds."""
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            out[sample.name, sample.labels.get("reason", "")] = sample.value
    return out


def test_a_router_over_a_remote_daemon_reexports_every_engine_counter():
    # The daemon: a router itself over two engines, so the remote reader adds them up.
    daemon = ServerMetrics("m", lambda: {"0": engine_stats(0), "1": engine_stats(1000)})
    remote_stats = stats_from_metrics(daemon.render().decode())
    for i, key in enumerate(ENGINE_COUNTERS, start=1):
        assert remote_stats[key] == 2 * i + 1000, key
    assert remote_stats[restarts_key("cache_error")] == 1200
    assert remote_stats["num_requests_running"] == 4
    assert remote_stats["kv_cache_usage_perc"] == 0.25  # averaged, not added

    # The router: that remote engine under its own engine id, exported with the same names.
    router = samples(ServerMetrics("m", lambda: {"r": remote_stats}).render())
    for key in ENGINE_COUNTERS:
        assert router[f"yaied:{key}_total", ""] == remote_stats[key], key
    for key in ENGINE_GAUGES:
        assert router[f"yaied:{key}", ""] == remote_stats[key], key
    assert router["yaied:engine_restarts_total", "cache_error"] == 1200
