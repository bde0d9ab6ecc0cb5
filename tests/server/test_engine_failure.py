"""A request the engine fails gets a 500 (or an error chunk once streaming); the server and the
engine keep serving the requests after it."""

from __future__ import annotations

import httpx
import orjson
import pytest

from tests.server.conftest import engine_loader, start_server, stop_server
from yaied.server.config import ServerConfig


@pytest.fixture(scope="module")
def tiny(tiny_model_dirs):
    loader = engine_loader(model=str(tiny_model_dirs["llama"]), max_model_len=0, threads=1)
    server = start_server(ServerConfig(served_model_name="tiny"), loader, "ignored")
    engine = server.server.config.app.state.server.engine

    def fail_marked_requests(batch):
        if any(seq.request_id.startswith("boom") for seq in batch.seqs):
            raise RuntimeError("injected worker failure")

    engine.worker.fault_hook = fail_marked_requests
    yield server
    engine.worker.fault_hook = None
    stop_server(server)


BODY = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0}


def test_failed_request_is_a_500_and_the_next_one_succeeds(tiny):
    failed = httpx.post(f"{tiny.v1}/completions", json=BODY, headers={"X-Request-Id": "boom-a"})
    assert failed.status_code == 500
    error = failed.json()["error"]
    # The exception's text stays in the log; the client gets its request id to look it up.
    assert "injected worker failure" not in error["message"] and error["type"]
    assert "boom-a" in error["message"]
    ok = httpx.post(f"{tiny.v1}/completions", json=BODY)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4


def test_failed_stream_ends_with_an_error_chunk_then_done(tiny):
    lines = []
    with httpx.stream(
        "POST",
        f"{tiny.v1}/completions",
        json={**BODY, "stream": True},
        headers={"X-Request-Id": "boom-b"},
    ) as response:
        assert response.status_code == 200  # the stream had started
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    message = orjson.loads(lines[-2][6:])["error"]["message"]
    assert "generation failed" in message and "injected worker failure" not in message
    ok = httpx.post(f"{tiny.v1}/completions", json=BODY)
    assert ok.status_code == 200
