"""The issue's cases over HTTP, on a daemon with its in-process engine 0 and an engine process
added over the API: 16 streams on the engine process when it is killed, then 8 streams on
engine 0 when ``DELETE /v1/engines/0`` removes it. Every stream moves to the other engine and
finishes with ``length``, its tokens those greedy decoding gives without the move (fp32), its
usage counting the original prompt; /health answers 200 throughout."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import threading
import time

import httpx
import orjson
import pytest

from tests.server.conftest import start_server, stop_server
from yaied.core.config import load_config
from yaied.engine.async_engine import AsyncEngine
from yaied.router.config import RouterConfig
from yaied.router.manager import EngineManager
from yaied.server.config import ServerConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]  # an engine process
ADMIN = {"Authorization": "Bearer admin-secret"}
KEYS = ("admin-secret name=ops admin=true",)
PROMPT = list(range(5, 25))  # longer than the long-call threshold: it follows its session's pin
MAX_TOKENS = 800


def body(stream: bool) -> dict:
    return {
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
        "return_token_ids": True,  # the tiny model has no tokenizer
        **({"stream_options": {"include_usage": True}} if stream else {}),
    }


def stream(client: httpx.Client, session: str, start: threading.Barrier) -> list[dict]:
    headers = {**ADMIN, "X-Session-Id": session}
    chunks = []
    start.wait(timeout=30)
    with client.stream("POST", "/v1/completions", json=body(True), headers=headers) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(orjson.loads(line[6:]))
    return chunks


def wait_for(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def daemon(tiny_model_dirs):
    """A daemon serving the tiny model on its in-process engine 0, plus a local engine process
    added over the API; and the session's greedy reference output (from engine 0)."""
    config = load_config(
        env={},
        overrides={
            "model": str(tiny_model_dirs["llama"]),
            "dtype": "float32",
            "kv_cache_gib": 0.02,
            "threads": 1,
        },
    )
    router = RouterConfig(long_call_threshold=8, restart_backoff_seconds=0.2)
    live = start_server(
        ServerConfig(api_keys=KEYS),
        lambda: EngineManager.single(AsyncEngine(config, show_progress=False), router),
        "tiny",
    )
    try:
        url, manager = live.url, live.server.config.app.state.server.manager
        # The session's first call pins it to engine 0, and is the reference.
        headers = {**ADMIN, "X-Session-Id": "s"}
        first = httpx.post(url + "/v1/completions", json=body(False), headers=headers, timeout=60)
        reference = first.json()["choices"][0]["token_ids"]
        assert len(reference) == MAX_TOKENS
        added = httpx.post(
            url + "/v1/engines", json={"kind": "local", "threads": 1}, headers=ADMIN
        ).json()
        wait_for(lambda: manager.engine_state(added["id"]) == "up", timeout=120)
        yield live, manager, added["id"], reference
    finally:
        stop_server(live)


def check_streams(results: list[list[dict]], reference: list[int]) -> None:
    for chunks in results:
        reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert [r for r in reasons if r is not None] == ["length"]
        tokens = [t for c in chunks for choice in c["choices"] for t in choice["token_ids"]]
        assert tokens == reference
        usage = chunks[-1]["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (20, MAX_TOKENS)


def open_streams(live, manager, n: int, session: str, then) -> tuple[list, set[int]]:
    """``n`` streams of ``session``; once all stream, ``then()``; their chunks, and every
    /health status seen until they ended."""
    health: set[int] = set()
    # The streams leave together, over one client made beforehand: each started on its own
    # (a client apiece, threads starting one by one) on a loaded machine, the first could end
    # before the last had begun, and the moment when all n stream never came.
    start = threading.Barrier(n)
    limits = httpx.Limits(max_connections=n)
    with (
        httpx.Client(base_url=live.url, limits=limits, timeout=60) as client,
        concurrent.futures.ThreadPoolExecutor(n) as pool,
    ):
        futures = [pool.submit(stream, client, session, start) for _ in range(n)]

        def all_streaming() -> bool:
            ended = [f for f in futures if f.done()]
            assert not ended, f"{len(ended)} stream(s) ended before all {n} were streaming"
            return len(manager._calls) == n and manager.num_calls_waiting == 0

        wait_for(all_streaming)
        then()
        while not all(f.done() for f in futures):
            health.add(httpx.get(live.url + "/health").status_code)
            time.sleep(0.05)
        return [f.result() for f in futures], health


def test_a_killed_engine_process_moves_its_16_streams(daemon):
    live, manager, added, reference = daemon
    # The session's calls go to the engine process (its id as the router sees it: scoped by the
    # key's name, server/keys.py).
    manager.coordinator.set_pin("ops:k", added)
    moved_before = manager.migrations["moved"]
    handle = manager.handles[added]
    pid = handle.pid

    def kill() -> None:
        assert {call.engine_id for call in manager._calls.values()} == {added}
        os.kill(pid, signal.SIGKILL)

    results, health = open_streams(live, manager, 16, "k", kill)
    assert health == {200}
    check_streams(results, reference)
    assert manager.migrations["moved"] - moved_before == 16
    wait_for(lambda: handle.health.value == "up" and handle.pid != pid, timeout=60)


def test_removing_an_engine_with_8_streams_open_moves_every_stream(daemon):
    live, manager, added, reference = daemon
    moved_before = manager.migrations["moved"]

    def remove() -> None:
        assert {call.engine_id for call in manager._calls.values()} == {"0"}
        removed = httpx.delete(live.url + "/v1/engines/0?timeout=0.2", headers=ADMIN)
        assert removed.status_code == 202, removed.text

    results, health = open_streams(live, manager, 8, "s", remove)
    assert health == {200}
    check_streams(results, reference)
    assert manager.migrations == {"moved": moved_before + 8, "failed": 0}
    metrics = httpx.get(live.url + "/metrics").text
    moved = f'yaied:call_migrations_total{{model_name="tiny",outcome="moved"}} {moved_before + 8}.0'
    assert moved in metrics
    wait_for(lambda: manager.engine_state("0") == "removed", timeout=20)
