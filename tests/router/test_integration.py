"""The router over real engines on CPU: two local engine processes and one remote daemon on
loopback, all serving a tiny random-weight model, behind the real HTTP app."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from collections.abc import Iterator

import httpx
import orjson
import pytest

from tests.server.conftest import LiveServer, engine_loader, start_server, stop_server
from yaied.core.config import load_config
from yaied.router.build import build_manager
from yaied.router.config import EngineEntry, RouterConfig
from yaied.server.config import ServerConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]  # engine processes and a daemon
LONG_CALL = 64  # the test router's long_call_threshold, so that short prompts count as long


@pytest.fixture(scope="module")
def cluster(tiny_model_dirs) -> Iterator[tuple[LiveServer, LiveServer]]:
    model = str(tiny_model_dirs["llama"])
    loader = engine_loader(model=model, threads=1, dtype="float32")
    remote = start_server(ServerConfig(), loader, "tiny")
    # fp32 everywhere: a call moved between engines recomputes its output as a prompt, and only
    # in fp32 is that bit-for-bit what decoding gave (the moved streams are compared).
    engine_config = load_config(
        env={}, overrides={"model": model, "kv_cache_gib": 0.01, "dtype": "float32"}
    )
    router_config = RouterConfig(
        long_call_threshold=LONG_CALL,
        health_check_interval_seconds=0.5,
        restart_backoff_seconds=0.2,
    )
    entries = (
        EngineEntry(device="cpu", threads=1),
        EngineEntry(device="cpu", threads=1),
        EngineEntry(kind="remote", url=remote.url),
    )
    router = start_server(
        ServerConfig(served_model_name="tiny"),
        lambda: build_manager(engine_config, router_config, entries),
        "tiny",
    )
    yield router, remote
    stop_server(router)
    stop_server(remote)


def manager_of(live: LiveServer):
    return live.server.config.app.state.server.manager


def body(max_tokens: int, prompt: list[int] | None = None, stream: bool = True) -> dict:
    return {
        "prompt": prompt or [1, 2, 3],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
        "return_token_ids": True,  # the tiny model has no tokenizer: chunks carry ids, not text
        **({"stream_options": {"include_usage": True}} if stream else {}),
    }


def stream_chunks(url: str, payload: dict, headers: dict, on_first=None) -> list[dict]:
    """The stream's JSON chunks; ``on_first`` runs once the first one has arrived."""
    chunks = []
    with httpx.stream(
        "POST", url + "/v1/completions", json=payload, headers=headers, timeout=60
    ) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(orjson.loads(line[6:]))
                if len(chunks) == 1 and on_first is not None:
                    on_first()
    return chunks


def finish_reason(chunks: list[dict]) -> str | None:
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
    return reasons[-1] if reasons else None


def wait_for(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def all_pages_free(router: LiveServer, remote: LiveServer) -> bool:
    manager = manager_of(router)
    local = [manager.get_engine_status(i).stats for i in ("0", "1")]
    stats = [*local, manager_of(remote).stats()]
    return all(s is not None and s["num_free_pages"] == s["num_pages"] for s in stats)


def test_engines_are_listed_and_load_spreads(cluster):
    router, _ = cluster
    listing = httpx.get(router.url + "/v1/engines").json()["data"]
    assert [(e["id"], e["kind"], e["health"]) for e in listing] == [
        ("0", "local", "up"),
        ("1", "local", "up"),
        ("2", "remote", "up"),
    ]
    ids = [f"spread-{i}" for i in range(6)]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        results = list(
            pool.map(
                lambda rid: stream_chunks(router.url, body(40), {"X-Request-Id": rid}),
                ids,
            )
        )
    assert all(finish_reason(chunks) == "length" for chunks in results)
    engines = [manager_of(router).lifecycle.by_client_id(rid)[0].engine_id for rid in ids]
    assert set(engines) == {"0", "1", "2"}, engines
    metrics = httpx.get(router.url + "/metrics").text
    for engine_id in ("0", "1", "2"):
        assert f'engine="{engine_id}"' in metrics


def test_a_long_session_stays_on_its_engine_and_hits_its_cache(cluster):
    router, _ = cluster
    prompt = list(range(1, LONG_CALL + 40))
    engines, cached = [], []
    for turn in range(3):
        rid = f"long-{turn}"
        headers = {"X-Session-Id": "long-session", "X-Request-Id": rid}
        chunks = stream_chunks(router.url, body(8, prompt), headers)
        cached.append(chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"])
        engines.append(manager_of(router).lifecycle.by_client_id(rid)[0].engine_id)
        prompt = prompt + [7] * 8 + list(range(10, 30))  # the next turn extends the context
    assert len(set(engines)) == 1, engines
    assert cached[0] == 0 and cached[1] > 0 and cached[2] > cached[1]
    assert manager_of(router).coordinator.session_hit_rate("long-session") > 0


def test_cancel_request_and_cancel_session_end_streams_with_abort(cluster):
    router, remote = cluster
    url = router.url

    def cancel(path: str) -> None:
        assert httpx.post(url + path, timeout=10).status_code == 200

    alone = stream_chunks(
        url,
        body(1000),
        {"X-Request-Id": "cancel-me"},
        lambda: cancel("/v1/requests/cancel-me/cancel"),
    )
    assert finish_reason(alone) == "abort"
    headers = [{"X-Session-Id": "doomed", "X-Request-Id": f"doomed-{i}"} for i in range(3)]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(stream_chunks, url, body(1000), h) for h in headers]
        lifecycle = manager_of(router).lifecycle
        wait_for(  # every stream is running: its first event has reached the router
            lambda: all(
                [r.started_at is not None for r in lifecycle.by_client_id(h["X-Request-Id"])]
                == [True]
                for h in headers
            )
        )
        response = httpx.post(url + "/v1/sessions/doomed/cancel", timeout=10)
        assert response.json()["cancelled"] == 3
        results = [f.result(timeout=30) for f in futures]
    assert [finish_reason(chunks) for chunks in results] == ["abort"] * 3
    engines = {
        manager_of(router).lifecycle.by_client_id(h["X-Request-Id"])[0].engine_id for h in headers
    }
    assert engines == {"0", "1", "2"}  # the session's calls were short: spread, then all cancelled
    assert httpx.post(url + "/v1/requests/nope/cancel").status_code == 404
    pair = stream_chunks(
        url,
        {**body(1000), "n": 2},
        {"X-Request-Id": "pair"},
        lambda: cancel("/v1/requests/pair/cancel"),  # both choices of it
    )
    reasons = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"] for c in pair[:-1]}
    assert reasons == {0: "abort", 1: "abort"}
    wait_for(lambda: all_pages_free(router, remote))


def stream_tokens(chunks: list[dict]) -> list[int]:
    return [
        t for c in chunks for choice in c.get("choices", []) for t in choice.get("token_ids", [])
    ]


def test_a_killed_engine_moves_its_streams_and_comes_back(cluster):
    router, _ = cluster
    manager = manager_of(router)
    reference = stream_tokens(stream_chunks(router.url, body(600), {}))
    moved_before = manager.migrations["moved"]
    headers = [{"X-Request-Id": f"kill-{i}"} for i in range(3)]
    health: set[int] = set()
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(stream_chunks, router.url, body(600), h) for h in headers]
        record = lambda h: manager.lifecycle.by_client_id(h["X-Request-Id"])[0]  # noqa: E731
        wait_for(lambda: all(manager.lifecycle.by_client_id(h["X-Request-Id"]) for h in headers))
        # The victim is the local engine of the first call routed to one: the three requests
        # race to the router, so any of them may have gone to the remote engine (no process).
        routed = {c.client_id: c.engine_id for c in manager._calls.values()}
        local = [h for h in headers if manager.handles[routed[h["X-Request-Id"]]].kind == "local"]
        victim = manager.handles[routed[local[0]["X-Request-Id"]]]
        old_pid = victim.pid
        on_victim = [h for h in headers if routed.get(h["X-Request-Id"]) == victim.engine_id]
        wait_for(lambda: record(on_victim[0]).started_at)
        os.kill(old_pid, signal.SIGKILL)
        while not all(f.done() for f in futures):
            health.add(httpx.get(router.url + "/health").status_code)
            time.sleep(0.05)
        results = {h["X-Request-Id"]: f.result() for h, f in zip(headers, futures, strict=True)}
    for chunks in results.values():
        # The victim's calls went on on the other local engine (the remote one cannot resume):
        # one stream each, every token once, greedy as without the move, one finish.
        assert finish_reason(chunks) == "length", chunks[-1]
        assert stream_tokens(chunks) == reference
        usage = chunks[-1]["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (3, 600)
    moves = [m for h in on_victim for m in record(h).moves]
    assert record(on_victim[0]).moves and all(m.from_engine == victim.engine_id for m in moves)
    assert manager.migrations["moved"] - moved_before == len(moves)
    assert health == {200}
    wait_for(lambda: victim.health.value == "up" and victim.pid != old_pid, timeout=60)
    again = stream_chunks(router.url, body(4), {"X-Request-Id": "after-restart"})
    assert finish_reason(again) == "length"
