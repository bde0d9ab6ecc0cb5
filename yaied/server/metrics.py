"""Prometheus metrics, in a registry of the app's own (never the process-global one).

Names follow DESIGN.md (vLLM's semantics, prefix ``yaied:``), labelled ``model_name`` and
``engine``. Gauges and the engine's own counters are read from ``engine.stats()`` at scrape time
by a custom collector, so they can never drift from the engine; per-request counters and
histograms are observed by the server as each request's events pass through it. The pod-level
gauges a Gateway API Inference Extension endpoint picker reads are exported under its names too
(``InferenceExtensionCollector``), and the standard ``process_*`` series of the daemon's own
process (prometheus-client's ProcessCollector).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from yaied.core.metric_names import (
    CALL_MIGRATIONS,
    CALL_MIGRATIONS_DOC,
    ENGINE_AVERAGED,
    ENGINE_COUNTERS,
    ENGINE_GAUGES,
    INFERENCE_EXTENSION_NAMES,
    LORA_REQUESTS_INFO,
    MIGRATION_OUTCOMES,
    PREFIX,
    RESTARTS,
    RESTARTS_DOC,
    RESTARTS_PREFIX,
)
from yaied.core.request import TokenEvent

# Engine id -> that engine's stats() (the engines that report them); None while none is loaded.
StatsFn = Callable[[], dict[str, dict[str, int | float]] | None]
# The engines GET /v1/engines lists (live and recently removed), and the removed ones' last
# counters (router/status.py); None while none is loaded.
ListedFn = Callable[[], tuple[set[str], dict[str, dict[str, int | float]]] | None]
# The front end's grammar compile cache counters (engine/grammar.py Grammars.stats); None before
# the first constrained request.
GrammarStatsFn = Callable[[], dict[str, int | float] | None]

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0,
)  # fmt: skip
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0, 1920.0)  # fmt: skip
_ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# A small schema compiles in milliseconds, a large one in a second or more (the timeout is 10 s).
_COMPILE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# The pool: engines per state, the autoscaler's events per direction and the calls' migrations
# per outcome; None before loading.
PoolStatsFn = Callable[[], tuple[dict[str, int], dict[str, int], dict[str, int]] | None]


class EngineStatsCollector:
    """Gauges and engine counters from one ``stats()`` call per engine per scrape; a removed
    engine's counters as it reported them last, while it is listed (``listed``), frozen: they
    count what happened, and a sum over engines must not drop when one goes."""

    def __init__(self, stats: StatsFn, model_name: str, listed: ListedFn | None = None) -> None:
        self._stats = stats
        self._model_name = model_name
        self._listed = listed or (lambda: None)

    def collect(self) -> Iterator[Metric]:
        live = self._stats() or {}
        listed = self._listed()
        removed = {k: v for k, v in (listed[1] if listed else {}).items() if k not in live}
        if not live and not removed:  # while no engine reports, the removed' counters stay
            return
        names = ["model_name", "engine"]
        families: dict[str, Metric] = {}
        # The table in core/metric_names.py; prometheus adds the counters' _total suffix.
        for name, doc in ENGINE_GAUGES.items():
            families[name] = GaugeMetricFamily(f"{PREFIX}{name}", doc, labels=names)
        for name, doc in ENGINE_COUNTERS.items():
            families[name] = CounterMetricFamily(f"{PREFIX}{name}", doc, labels=names)
        restarts = CounterMetricFamily(
            f"{PREFIX}{RESTARTS}", RESTARTS_DOC, labels=[*names, "reason"]
        )
        for engine_id, stats in [*removed.items(), *live.items()]:
            # A removed engine's entry holds counters only: no gauge, KV usage included.
            values = (
                stats
                if engine_id in removed
                else {**stats, "kv_cache_usage_perc": _kv_usage(stats)}
            )
            for name, family in families.items():
                if name in values:
                    family.add_metric([self._model_name, engine_id], values[name])
            for key, value in stats.items():
                if key.startswith(RESTARTS_PREFIX):
                    reason = key.removeprefix(RESTARTS_PREFIX)
                    restarts.add_metric([self._model_name, engine_id, reason], value)
        yield from families.values()
        yield restarts


class InferenceExtensionCollector:
    """The pod-level gauges an Inference Extension endpoint picker reads, under the names it
    reads (core/metric_names.py INFERENCE_EXTENSION_NAMES): one series each, for the whole
    daemon, however many engines it runs."""

    def __init__(self, stats: StatsFn, model_name: str) -> None:
        self._stats = stats
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        per_engine = self._stats()
        if not per_engine:
            return
        engines = [{**s, "kv_cache_usage_perc": _kv_usage(s)} for s in per_engine.values()]
        for key, names in INFERENCE_EXTENSION_NAMES.items():
            value = sum(float(stats.get(key, 0)) for stats in engines)
            if key in ENGINE_AVERAGED:
                value /= len(engines)
            for name in names:
                gauge = GaugeMetricFamily(name, ENGINE_GAUGES[key], labels=["model_name"])
                gauge.add_metric([self._model_name], value)
                yield gauge
        lora = GaugeMetricFamily(
            LORA_REQUESTS_INFO,
            "LoRA adapters running and waiting (none: yaied serves no adapters).",
            labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
        )
        lora.add_metric(["", "", "0"], time.time())  # as vLLM: the value is the scrape time
        yield lora


def _kv_usage(stats: dict[str, int | float]) -> float:
    """Pages held by requests; cached pages nobody holds are evictable on demand, so free. A
    remote engine reports the ratio itself."""
    if "num_pages" not in stats:
        return float(stats.get("kv_cache_usage_perc", 0.0))
    return 1.0 - stats["num_free_pages"] / stats["num_pages"] if stats["num_pages"] else 0.0


class GrammarStatsCollector:
    """The compile cache's hits and misses, read from the front end's compiler at scrape time:
    the compile on the request path (an engine in another process compiles again, in its own
    cache, uncounted here). Labelled like the server's own series (engine "0": the in-process
    engine of a single-engine daemon, whose compiler this is)."""

    def __init__(self, stats: GrammarStatsFn, labels: dict[str, str]) -> None:
        self._stats = stats
        self._labels = labels

    def collect(self) -> Iterator[Metric]:
        stats = self._stats() or {}
        docs = {
            "hits": "Structured-output specs found compiled in the cache.",
            "misses": "Structured-output specs that started a compile.",
        }
        for key, doc in docs.items():
            family = CounterMetricFamily(
                f"yaied:structured_output_compile_cache_{key}", doc, labels=list(self._labels)
            )
            family.add_metric(list(self._labels.values()), stats.get(key, 0))
            yield family


class PoolCollector:
    """``yaied:engines{state}``, ``yaied:autoscale_events_total{direction}`` and
    ``yaied:call_migrations_total{outcome}``, read from the manager at scrape time
    (router/pool.py, router/autoscale.py, router/manager.py)."""

    def __init__(self, pool_stats: PoolStatsFn, model_name: str) -> None:
        self._pool_stats = pool_stats
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self._pool_stats()
        if stats is None:
            return
        states, events, migrations = stats
        engines = GaugeMetricFamily(
            "yaied:engines",
            "Engines behind the router, by state (starting, up, draining, down, removed).",
            labels=["model_name", "state"],
        )
        for state, count in states.items():
            engines.add_metric([self._model_name, state], count)
        scaling = CounterMetricFamily(
            "yaied:autoscale_events",
            "Engines the autoscaler added (up) and removed (down), and times an up found no "
            "room for its engine in this machine's memory or cores (up_refused).",
            labels=["model_name", "direction"],
        )
        for direction, count in events.items():
            scaling.add_metric([self._model_name, direction], count)
        moves = CounterMetricFamily(
            f"{PREFIX}{CALL_MIGRATIONS}", CALL_MIGRATIONS_DOC, labels=["model_name", "outcome"]
        )
        for outcome in MIGRATION_OUTCOMES:
            moves.add_metric([self._model_name, outcome], migrations.get(outcome, 0))
        yield engines
        yield scaling
        yield moves


class ServerMetrics:
    def __init__(
        self,
        model_name: str,
        stats: StatsFn,
        grammar_stats: GrammarStatsFn | None = None,
        pool_stats: PoolStatsFn | None = None,
        listed: ListedFn | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        self._listed = listed or (lambda: None)
        self._engines_seen: set[str] = set()  # the engine labels the series below carry
        self.labels = {"model_name": model_name, "engine": "0"}
        names = list(self.labels)
        reg = self.registry

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"yaied:{name}", doc, [*names, *extra], registry=reg)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"yaied:{name}", doc, names, registry=reg, buckets=buckets)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.request_success = counter(
            "request_success", "Requests finished, by reason.", ("finished_reason",)
        )
        self.ttft = histogram(
            "time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS
        )
        self.itl = histogram("inter_token_latency_seconds", "Time between tokens.", _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Request latency.", _E2E_BUCKETS)
        # Approximated as the time to first token minus the last step's length (see RequestTimer).
        self.queue_time = histogram(
            "request_queue_time_seconds", "Time waiting before the prefill.", _LATENCY_BUCKETS
        )
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Tokens per engine step.", _ITERATION_BUCKETS
        )
        # The front end's compiles (see GrammarStatsCollector for the labels).
        self.compile_seconds = histogram(
            "structured_output_compile_seconds",
            "Seconds to compile a structured-output spec (cache misses only).",
            _COMPILE_BUCKETS,
        )
        self.registry.register(EngineStatsCollector(stats, model_name, self._listed))
        self.registry.register(InferenceExtensionCollector(stats, model_name))
        self.registry.register(GrammarStatsCollector(grammar_stats or (lambda: None), self.labels))
        self.registry.register(PoolCollector(pool_stats or (lambda: None), model_name))
        # process_resident_memory_bytes and the rest, as any Python service exports them: the
        # daemon's own process (engine child processes are not in it; systemd's MemoryCurrent
        # counts the whole unit)
        ProcessCollector(registry=self.registry)
        # The series of each engine (compile_seconds is the front end's, under engine "0").
        self._per_engine = (
            self.prompt_tokens,
            self.generation_tokens,
            self.request_success,
            self.ttft,
            self.itl,
            self.e2e,
            self.queue_time,
            self.iteration_tokens,
        )
        for metric in (self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.e2e,
                       self.queue_time, self.iteration_tokens, self.compile_seconds):  # fmt: skip
            metric.labels(**self.labels)  # present (at 0) before the first request
        self._engines_seen.add(self.labels["engine"])

    def engine_labels(self, engine_id: str) -> dict[str, str]:
        self._engines_seen.add(engine_id)
        return {**self.labels, "engine": engine_id}

    def _forget_unlisted(self) -> None:
        """Every series of an engine no longer listed (removed long enough ago: router/pool.py
        keeps the last _REMOVED_KEPT) goes, so an autoscaler's churn of engines does not grow
        /metrics without bound; a removed engine still listed keeps its counters, frozen."""
        listed = self._listed()
        if listed is None:
            return
        for engine_id in self._engines_seen - listed[0]:
            for metric in self._per_engine:
                metric.remove_by_labels({"engine": engine_id})
            self._engines_seen.discard(engine_id)

    def observe_step(self, engine_id: str, num_tokens: int) -> None:
        """One engine step's size (the engine task calls it: cheap, never raises)."""
        self.iteration_tokens.labels(**self.engine_labels(engine_id)).observe(num_tokens)

    def observe_compile(self, seconds: float) -> None:
        """One grammar compile (the compiler's hook, in a compile thread: prometheus_client's
        metrics are thread-safe)."""
        self.compile_seconds.labels(**self.labels).observe(seconds)

    def render(self) -> bytes:
        self._forget_unlisted()
        return generate_latest(self.registry)

    def timer(self) -> RequestTimer:
        return RequestTimer(self)


@dataclass(slots=True)
class RequestTimer:
    """One request's timings, observed as its events pass through the server. Queue time is the
    engine's own: from the request's arrival to its first admission by the scheduler."""

    metrics: ServerMetrics
    engine: str = "0"  # the engine serving the request (set by the caller once routed)
    start: float = field(default_factory=time.monotonic)
    first: float | None = None
    last: float | None = None
    finished: bool = False
    # A call resumed here (resume_token_ids): its tokens generated elsewhere, not counted here.
    num_generated_before: int = 0

    def on_event(self, event: TokenEvent) -> None:
        now = time.monotonic()
        m, labels = self.metrics, self.metrics.engine_labels(self.engine)
        if event.token_ids:
            if self.first is None:
                self.first = now
                m.ttft.labels(**labels).observe(now - self.start)
                if event.queue_time is not None:
                    m.queue_time.labels(**labels).observe(event.queue_time)
            elif self.last is not None:
                m.itl.labels(**labels).observe(now - self.last)
            self.last = now
        if event.finished:
            self.finish(event.finish_reason.value, event.num_prompt_tokens, event.num_output_tokens)

    def finish(self, reason: str, num_prompt_tokens: int, num_output_tokens: int) -> None:
        if self.finished:
            return
        self.finished = True
        m, labels = self.metrics, self.metrics.engine_labels(self.engine)
        m.e2e.labels(**labels).observe(time.monotonic() - self.start)
        m.prompt_tokens.labels(**labels).inc(num_prompt_tokens)
        m.generation_tokens.labels(**labels).inc(num_output_tokens - self.num_generated_before)
        m.request_success.labels(**labels, finished_reason=reason).inc()
