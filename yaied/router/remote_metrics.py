"""A remote daemon's engine counters, read from its Prometheus /metrics text.

The keys are AsyncEngine.stats()'s, so the router's own /metrics reports a remote engine with the
same names as a local one. A remote that is itself a router reports several engines: they add up.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from yaied.router.handle import Stats

# Remote sample name -> stats key.
_SUMMED = {
    "yaied:num_requests_running": "num_requests_running",
    "yaied:num_requests_waiting": "num_requests_waiting",
    "yaied:prefix_cache_queries_total": "prefix_cache_queries",
    "yaied:prefix_cache_hits_total": "prefix_cache_hits",
    "yaied:num_preemptions_total": "num_preemptions",
    "yaied:structured_output_mask_seconds_total": "structured_output_mask_seconds",
    "yaied:structured_output_masked_steps_total": "structured_output_masked_steps",
}
_USAGE = "yaied:kv_cache_usage_perc"


def stats_from_metrics(text: str) -> Stats:
    stats: Stats = dict.fromkeys(_SUMMED.values(), 0)
    usages: list[float] = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in _SUMMED:
                stats[_SUMMED[sample.name]] += sample.value
            elif sample.name == _USAGE:
                usages.append(sample.value)
    stats["kv_cache_usage_perc"] = sum(usages) / len(usages) if usages else 0.0
    return stats
