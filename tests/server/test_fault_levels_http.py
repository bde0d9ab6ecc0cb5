"""Level 2 of the escalation order through HTTP: corrupt bookkeeping fails the requests in flight,
the engine rebuilds in-process, /health stays 200, the next request succeeds and the restart is
counted in /metrics."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import engine_loader, start_server, stop_server
from tests.server.test_faults import wait_idle
from yaied.cache.radix_cache import TreeNode
from yaied.server.config import ServerConfig

BODY = {"model": "tiny", "temperature": 0, "ignore_eos": True}


def restarts(url: str) -> dict[str, float]:
    families = text_string_to_metric_families(httpx.get(url + "/metrics").text)
    (family,) = [f for f in families if f.name == "yaied:engine_restarts"]
    return {s.labels["reason"]: s.value for s in family.samples if s.name.endswith("_total")}


@pytest.mark.timeout(90)
def test_corrupt_cache_state_restarts_the_engine_not_the_daemon(tiny_model_dirs):
    loader = engine_loader(
        model=str(tiny_model_dirs["llama"]), max_model_len=0, threads=1, max_num_batched_tokens=16
    )
    server = start_server(ServerConfig(served_model_name="tiny"), loader, "ignored")
    try:
        engine = server.server.config.app.state.server.engine
        url = server.url + "/v1/completions"
        assert set(restarts(server.url).values()) == {0.0}
        results = {}

        def long_request() -> None:
            body = {**BODY, "prompt": list(range(1, 60)), "max_tokens": 400}
            results["long"] = httpx.post(url, json=body, timeout=60)

        thread = threading.Thread(target=long_request)
        thread.start()
        deadline = time.monotonic() + 30
        while not engine.scheduler.running and time.monotonic() < deadline:
            time.sleep(0.01)
        (victim,) = engine.scheduler.running
        # As the original bug did: a prefix node that is not in the tree. The next chunk (or the
        # finish) that touches it raises inside the radix cache.
        victim.prefix_node = TreeNode(tokens=(), pages=[], parent=None)
        thread.join(60)
        failed = results["long"]
        assert failed.status_code == 500 and "restarted" in failed.json()["error"]["message"]
        assert httpx.get(server.url + "/health").status_code == 200
        ok = httpx.post(url, json={**BODY, "prompt": [1, 2, 3], "max_tokens": 4}, timeout=60)
        assert ok.status_code == 200
        assert restarts(server.url) == {
            "cache_error": 1.0,
            "loop_error": 0.0,
            "invariant": 0.0,
            "failed_steps": 0.0,
        }
        wait_idle(server.url)
    finally:
        stop_server(server)
