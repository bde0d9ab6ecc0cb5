"""/metrics once engines are removed (DELETE /v1/engines/{id}): a removed engine's gauges go at
once; its counters stay, frozen, while GET /v1/engines still lists it, so a sum over engines
never drops; once it leaves that list every series of it goes (no growth without bound under
an autoscaler's churn)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.router.test_manager import FakeEngine
from tests.server.conftest import in_process_server
from tests.server.test_engines_http import ADMIN, KEYS, _add, wait_for
from yaied.core.metric_names import ENGINE_GAUGES
from yaied.core.model_info import ModelInfo
from yaied.engine.inputs import InputProcessor
from yaied.router import pool
from yaied.router.config import RouterConfig
from yaied.router.manager import EngineManager
from yaied.server.config import ServerConfig

pytestmark = pytest.mark.timeout(60)


class CountingEngine(FakeEngine):
    """A fake engine whose stats carry counters (the prompt tokens it was sent) and a gauge."""

    def __init__(self, engine_id: str) -> None:
        super().__init__(engine_id)
        self.queries = 0

    def submit(self, request_id, prompt_ids, params, *, session_id, priority, sink):
        self.queries += len(prompt_ids)
        super().submit(
            request_id, prompt_ids, params, session_id=session_id, priority=priority, sink=sink
        )

    def stats(self):
        return {
            "num_requests_waiting": 0,
            "num_requests_running": len(self.running),
            "prefix_cache_queries": self.queries,
            "engine_restarts_step_timeout": 1,
        }


def manager() -> EngineManager:
    config = RouterConfig(policy="round_robin", health_check_interval_seconds=0.2)
    manager = EngineManager(config)
    manager.add_engine(CountingEngine("0"), name="first")
    manager.inputs = InputProcessor(None, SimpleNamespace(eos_token_id=None), ModelInfo(8192, 256))
    return manager


def series(client) -> dict[tuple[str, str], float]:
    """(sample name, engine) -> value, for the samples labelled with an engine."""
    text = client.get("/metrics", headers=ADMIN).text
    return {
        (s.name, s.labels["engine"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if "engine" in s.labels and not s.name.endswith(("_bucket", "_created"))
    }


def total(values: dict[tuple[str, str], float], name: str) -> float:
    return sum(v for (n, _), v in values.items() if n == name)


def test_a_removed_engines_counters_stay_while_it_is_listed_then_all_its_series_go(monkeypatch):
    monkeypatch.setattr(pool, "_REMOVED_KEPT", 1)
    with in_process_server(ServerConfig(api_keys=KEYS), manager, "tiny") as client:
        router = client.app.state.server.manager
        for engine_id in ("1", "2"):
            client.portal.call(_add, router, CountingEngine(engine_id))
            wait_for(lambda e=engine_id: router.engine_state(e) == "up")
        for _ in range(6):  # round robin: two calls each
            body = {"prompt": [1, 2, 3], "max_tokens": 2}
            assert client.post("/v1/completions", json=body, headers=ADMIN).status_code == 200
        before = series(client)
        assert before[("yaied:prefix_cache_queries_total", "1")] == 6
        assert before[("yaied:prompt_tokens_total", "1")] == 6

        assert client.delete("/v1/engines/1?timeout=0", headers=ADMIN).status_code == 202
        wait_for(lambda: router.engine_state("1") == "removed")
        after = series(client)
        # Its gauges go (KV usage too: a 0 would pull an average down); its counters, the
        # engine's own and the server's, stay as they were.
        assert [f"yaied:{name}" for name in ENGINE_GAUGES if (f"yaied:{name}", "1") in after] == []
        for name in (
            "yaied:prefix_cache_queries_total",
            "yaied:engine_restarts_total",
            "yaied:prompt_tokens_total",
            "yaied:request_success_total",
        ):
            assert after[(name, "1")] == before[(name, "1")], name
            assert total(after, name) == total(before, name), name

        assert client.delete("/v1/engines/2?timeout=0", headers=ADMIN).status_code == 202
        wait_for(lambda: router.engine_state("2") == "removed")
        last = series(client)  # 1 is no longer listed (one removed engine kept): nothing of it
        assert not [key for key in last if key[1] == "1"], last
        assert last[("yaied:prefix_cache_queries_total", "2")] == 6
        assert last[("yaied:prompt_tokens_total", "2")] == 6
        listed = [e["id"] for e in client.get("/v1/engines", headers=ADMIN).json()["data"]]
        assert listed == ["0", "2"]
