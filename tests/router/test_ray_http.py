"""POST /v1/engines with a Ray engine on a daemon that has not joined Ray yet: joining (a local
Ray instance takes seconds to start) happens off the event loop, so /health and the streams of
the engines already serving never stall behind it, and resources no node has are one 400."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

ray = pytest.importorskip("ray")

from tests.server.conftest import start_server, stop_server  # noqa: E402
from tests.server.test_engines_http import fake_manager  # noqa: E402
from yaied.core.config import load_config  # noqa: E402
from yaied.server.config import ServerConfig  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
KEYS = ("admin-secret name=ops admin=true",)
ADMIN = {"Authorization": "Bearer admin-secret"}


def test_a_ray_engine_no_node_can_hold_is_a_400_and_stalls_nothing(tiny_model_dirs):
    if ray.is_initialized():
        pytest.skip("this process joined Ray already")
    engine_config = load_config(env={}, overrides={"model": str(tiny_model_dirs["llama"])})

    def load():
        manager = fake_manager()
        manager.engine_config = engine_config  # so that a ray engine may be added
        return manager

    live = start_server(ServerConfig(api_keys=KEYS), load, "tiny")
    gaps: list[float] = []
    statuses: set[int] = set()  # checked on the test's thread: an assert in this one is lost
    done = threading.Event()

    def watch_health() -> None:  # the longest wait for /health while Ray starts
        while not done.is_set():
            started = time.monotonic()
            statuses.add(httpx.get(live.url + "/health", timeout=30).status_code)
            gaps.append(time.monotonic() - started)
            time.sleep(0.02)

    watcher = threading.Thread(target=watch_health, daemon=True)
    watcher.start()
    try:
        for resources, shown in (
            # more than any machine has (a GPU box's local Ray has GPUs: none asks for one here)
            ({"CPU": 100000}, "CPU = 100000"),
            ({"GPU": 100000}, "GPU = 100000"),
            ({"no_such_thing": 1}, "no_such_thing = 1"),
        ):
            body = {"kind": "ray", "resources": resources}
            answer = httpx.post(live.url + "/v1/engines", json=body, headers=ADMIN, timeout=60)
            assert answer.status_code == 400, answer.text
            error = answer.json()["error"]
            assert error["message"].startswith("no Ray node can hold an engine of {" + shown)
            assert "\n" not in error["message"] and error["type"] == "invalid_request_error"
        listing = httpx.get(live.url + "/v1/engines", headers=ADMIN).json()["data"]
        assert [e["name"] for e in listing] == ["first"]
        done.set()
        watcher.join(30)
        assert gaps and statuses == {200}, statuses
        # Ray's start took 4.4 s on the loop before; a thread leaves /health well under that
        # (generous: two busy CPUs share the start with the watcher)
        assert max(gaps) < 2.5, f"/health waited {max(gaps):.1f} s while Ray started"
    finally:
        done.set()
        stop_server(live)
        ray.shutdown()
