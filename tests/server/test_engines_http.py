"""The engine routes: listing for anyone the keys let in; add, drain and remove for admin keys
only (403 for other keys and for everyone on a daemon without keys), over fake engines."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from tests.router.test_manager import FakeEngine
from tests.server.conftest import in_process_server
from yaied.core.config import load_config
from yaied.core.host_memory import GIB
from yaied.core.model_info import ModelInfo
from yaied.engine.inputs import InputProcessor
from yaied.router.config import EngineEntry, RouterConfig
from yaied.router.handle import Health
from yaied.router.manager import EngineManager
from yaied.router.room import HostRoom
from yaied.server.config import ServerConfig

pytestmark = pytest.mark.timeout(60)
ADMIN = {"Authorization": "Bearer admin-secret"}
USER = {"Authorization": "Bearer user-secret"}
KEYS = ("admin-secret name=ops admin=true", "user-secret name=user")
UNREACHABLE = {"kind": "remote", "url": "http://127.0.0.1:9", "api_key": "k", "name": "far"}


def fake_manager() -> EngineManager:
    manager = EngineManager(RouterConfig(health_check_interval_seconds=0.2))
    manager.add_engine(FakeEngine("0"), name="first")
    hf_config = SimpleNamespace(eos_token_id=None)
    manager.inputs = InputProcessor(None, hf_config, ModelInfo(8192, 256))
    return manager


def serve(keys: tuple[str, ...] = ()):
    return in_process_server(ServerConfig(api_keys=keys), fake_manager, "tiny")


def changes(client, headers: dict[str, str]) -> list[int]:
    """The status of each mutating route for these headers."""
    return [
        client.post("/v1/engines", json=UNREACHABLE, headers=headers).status_code,
        client.post("/v1/engines/first/drain", headers=headers).status_code,
        client.delete("/v1/engines/first", headers=headers).status_code,
    ]


def test_without_keys_anyone_lists_and_nobody_changes_the_engines():
    with serve() as client:
        listing = client.get("/v1/engines").json()["data"]
        assert [(e["id"], e["name"], e["state"]) for e in listing] == [("0", "first", "up")]
        assert changes(client, {}) == [403, 403, 403]
        assert changes(client, ADMIN) == [403, 403, 403]
        error = client.post("/v1/engines", json=UNREACHABLE).json()["error"]
        assert error["code"] == "admin_key_required"


def test_only_an_admin_key_changes_the_engines():
    with serve(KEYS) as client:
        assert client.get("/v1/engines").status_code == 401
        assert client.get("/v1/engines", headers=USER).status_code == 200
        assert changes(client, {}) == [401, 401, 401]
        assert changes(client, {"Authorization": "Bearer wrong"}) == [401, 401, 401]
        assert changes(client, USER) == [403, 403, 403]
        # The admin: add a remote engine (nothing answers there, so it is down and probed).
        added = client.post("/v1/engines", json=UNREACHABLE, headers=ADMIN)
        assert added.status_code == 202, added.text
        assert (added.json()["id"], added.json()["name"]) == ("1", "far")

        def states() -> dict[str, str]:
            listing = client.get("/v1/engines", headers=USER).json()["data"]
            return {engine["name"]: engine["state"] for engine in listing}

        wait_for(lambda: states()["far"] == "down")
        again = client.post("/v1/engines", json=UNREACHABLE, headers=ADMIN)
        assert again.status_code == 409  # names are unique among serving engines
        drained = client.post("/v1/engines/far/drain", headers=ADMIN)
        assert drained.status_code == 200 and drained.json()["state"] == "draining"
        assert client.delete("/v1/engines/1?timeout=0", headers=ADMIN).status_code == 202
        wait_for(lambda: states()["far"] == "removed")
        assert client.delete("/v1/engines/first", headers=ADMIN).status_code == 409  # the last
        assert client.delete("/v1/engines/nope", headers=ADMIN).status_code == 404
        assert client.delete("/v1/engines/0?timeout=x", headers=ADMIN).status_code == 400


@pytest.mark.parametrize(
    "body",
    [
        {"kind": "remote", "url": "http://h:1", "api_key_file": "/etc/shadow"},
        {"kind": "remote", "url": "http://h:1", "api_key_env": "HOME"},
        {"kind": "remote", "url": "ftp://h"},
        {"kind": "local", "gpu": 3},
        {"kind": "local", "device": "tpu"},
        {"kind": "local", "name": "bad name"},
    ],
)
def test_bad_engine_bodies_get_400(body):
    with serve(KEYS) as client:
        response = client.post("/v1/engines", json=body, headers=ADMIN)
        assert response.status_code == 400, response.text


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def test_with_every_engine_down_calls_get_503_with_retry_after_and_serve_again_later():
    with serve() as client:
        manager = client.app.state.server.manager
        engine = manager.handles["0"]
        body = {"prompt": [1, 2], "max_tokens": 2}
        engine.health = Health.DOWN
        refused = client.post("/v1/completions", json=body)
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
        assert client.get("/health").status_code == 503
        engine.health = Health.UP  # a restarted process, a remote probed back
        assert client.post("/v1/completions", json=body).status_code == 200


@pytest.mark.parametrize(
    ("health", "draining", "status", "code"),
    [
        (Health.DOWN, False, "restarting", "engine_restarting"),  # in its restart backoff
        (Health.STARTING, False, "restarting", "engine_restarting"),  # ... respawned, loading
        (Health.STOPPED, False, "dead", "engine_dead"),  # nothing brings it back
        (Health.DOWN, True, "dead", "engine_dead"),  # on its way out, not back
    ],
)
def test_health_with_no_engine_up_says_whether_one_is_coming_back(health, draining, status, code):
    """It said engine_dead while the router was restarting the engine: a 503 either way (a
    load balancer sends nothing here), but an operator reading it was told the daemon was dead
    when it only had to wait."""
    with serve() as client:
        manager = client.app.state.server.manager
        manager.handles["0"].health = health
        manager.pool["0"].draining = draining
        answer = client.get("/health")
        assert answer.status_code == 503 and answer.headers["Retry-After"] == "1"
        assert answer.json()["status"] == status
        assert answer.json()["error"]["code"] == code
        refused = client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == code
        manager.handles["0"].health = Health.UP
        manager.pool["0"].draining = False
        assert client.get("/health").json()["status"] == "ok"


def test_the_last_engine_up_stays_while_its_replacement_starts():
    """A replacement still starting (or down) serves nothing yet: removing or draining the one
    engine up would leave the daemon answering 503 (and, if the replacement never comes up, with
    no engine at all). Once the replacement is up, the old one goes."""
    with serve(KEYS) as client:
        manager = client.app.state.server.manager
        client.portal.call(_add, manager, StartsForever("1"))
        for refused in (
            client.delete("/v1/engines/first?timeout=0", headers=ADMIN),
            client.post("/v1/engines/first/drain", headers=ADMIN),
        ):
            assert refused.status_code == 409, refused.text
            assert refused.json()["error"]["code"] == "last_engine"
        # The one not serving may go: that changes nothing for the calls.
        assert client.delete("/v1/engines/1?timeout=0", headers=ADMIN).status_code == 202
        wait_for(lambda: manager.engine_state("1") == "removed")
        up = FakeEngine("2")
        client.portal.call(_add, manager, up)
        wait_for(lambda: manager.engine_state("2") == "up")
        assert client.delete("/v1/engines/first?timeout=0", headers=ADMIN).status_code == 202
        assert client.get("/health").status_code == 200


class StartsForever(FakeEngine):
    async def start(self) -> None:
        await asyncio.Event().wait()  # a model that takes its time to load


async def _add(manager: EngineManager, handle: FakeEngine) -> None:
    manager.add_engine(handle, origin="api")


def test_a_name_clash_is_409_and_other_refusals_are_400_whatever_they_say(monkeypatch):
    """The clash is told by its type, not by its words: a refusal of the input that happens to
    say "already" is still the client's bad input."""
    with serve(KEYS) as client:
        manager = client.app.state.server.manager
        clash = {"kind": "remote", "url": "http://127.0.0.1:9", "name": "first"}
        answer = client.post("/v1/engines", json=clash, headers=ADMIN)
        assert answer.status_code == 409, answer.text
        assert answer.json()["error"]["code"] == "engine_name_taken"
        assert "first" in answer.json()["error"]["message"]

        def refuse(engine_id, entry):
            raise ValueError("device cuda:0 is already held by engine 0")

        monkeypatch.setattr(manager, "_build_handle", refuse)
        answer = client.post("/v1/engines", json=UNREACHABLE, headers=ADMIN)
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["message"] == "device cuda:0 is already held by engine 0"


def cpu_manager() -> EngineManager:
    """fake_manager's, with the engine config local CPU engines are made from."""
    manager = fake_manager()
    config = {"device.device": "cpu", "cache.kv_cache_gib": 2.0}
    manager.engine_config = load_config(env={}, overrides=config)
    return manager


def test_a_local_cpu_engine_past_the_memory_or_cores_left_is_409_and_starts_nothing(monkeypatch):
    """An engine added over HTTP was started whatever the machine had left: past the memory,
    the OOM killer ended one mid-serve. Checked as a start is, against what is left now."""
    with in_process_server(ServerConfig(api_keys=KEYS), cpu_manager, "tiny") as client:
        manager = client.app.state.server.manager
        built: list[EngineEntry] = []

        def build(engine_id, entry):
            built.append(entry)
            return FakeEngine(engine_id)

        monkeypatch.setattr(manager, "_build_handle", build)

        def add(body: dict, available: int, cores: int):
            manager.room = HostRoom(GIB, available=lambda: available, cores=lambda: cores)
            return client.post("/v1/engines", json={"kind": "local", **body}, headers=ADMIN)

        # weights 1 GiB + KV pool 2 GiB + 256 MiB a process at the least: 3.25 GiB
        answer = add({"device": "cpu", "name": "big"}, 3 * GIB, 4)
        assert answer.status_code == 409, answer.text
        error = answer.json()["error"]
        assert error["code"] == "insufficient_memory" and error["type"] == "invalid_request_error"
        assert "need ~3.2 GiB" in error["message"] and "the 3.0 GiB" in error["message"]
        assert "big" in error["message"] and "kv_cache_gib" in error["message"]
        listing = client.get("/v1/engines", headers=ADMIN).json()["data"]
        assert built == [] and [engine["name"] for engine in listing] == ["first"]
        assert add({"device": "cpu", "name": "a"}, 64 * GIB, 2).status_code == 202
        wait_for(lambda: manager.engine_state(manager.find_engine("a")) == "up")
        # a, 1 core (its rank), and b's 2 threads: past the 2 cores
        answer = add({"device": "cpu", "name": "b", "threads": 2}, 64 * GIB, 2)
        assert answer.status_code == 409, answer.text
        error = answer.json()["error"]
        assert error["code"] == "insufficient_cores"
        assert "need 3 cores (a: 1, b: 2" in error["message"] and "the 2 this" in error["message"]
        assert [e.name for e in built] == ["a"]
        # GPU and remote engines are not this machine's memory: not checked here
        assert add({"device": "cuda:0", "name": "gpu"}, 0, 1).status_code == 202
