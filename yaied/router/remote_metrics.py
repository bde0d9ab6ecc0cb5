"""A remote daemon's engine counters, read from its Prometheus /metrics text.

The keys are AsyncEngine.stats()'s, so the router's own /metrics reports a remote engine with the
same names as a local one: both read the table in core/metric_names.py. A remote that is itself a
router reports several engines: they add up (the KV usage, a ratio, averages).
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from yaied.core.metric_names import (
    ENGINE_AVERAGED,
    ENGINE_COUNTERS,
    ENGINE_GAUGES,
    PREFIX,
    RESTARTS,
    restarts_key,
)
from yaied.router.handle import Stats

# Remote sample name -> stats key (the text format names a counter's sample <name>_total).
_SUMMED = {
    **{f"{PREFIX}{key}": key for key in ENGINE_GAUGES if key not in ENGINE_AVERAGED},
    **{f"{PREFIX}{key}_total": key for key in ENGINE_COUNTERS},
}
_AVERAGED = {f"{PREFIX}{key}": key for key in ENGINE_AVERAGED}
_RESTARTS = f"{PREFIX}{RESTARTS}_total"


def stats_from_metrics(text: str) -> Stats:
    stats: Stats = dict.fromkeys(_SUMMED.values(), 0)
    averaged: dict[str, list[float]] = {key: [] for key in _AVERAGED.values()}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in _SUMMED:
                stats[_SUMMED[sample.name]] += sample.value
            elif sample.name in _AVERAGED:
                averaged[_AVERAGED[sample.name]].append(sample.value)
            elif sample.name == _RESTARTS and "reason" in sample.labels:
                key = restarts_key(sample.labels["reason"])
                stats[key] = stats.get(key, 0) + sample.value
    for key, values in averaged.items():
        stats[key] = sum(values) / len(values) if values else 0.0
    return stats
