"""/v1/conversations with the official openai client on the default model: a conversation made
with items and metadata, responses run in it (their input and output appended, the history's
prefix from the cache), its items listed, added, read and deleted, and the 4xx of bad requests."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.conftest import MODEL


@pytest.fixture
def client(live):
    return openai.OpenAI(base_url=live.v1, api_key="none", max_retries=0)


def test_responses_run_in_a_conversation(client):
    first_item = {"type": "message", "role": "user", "content": "My name is Ada."}
    conversation = client.conversations.create(items=[first_item], metadata={"topic": "intro"})
    assert conversation.id.startswith("conv_") and conversation.metadata == {"topic": "intro"}
    run = dict(model=MODEL, max_output_tokens=8, temperature=0)
    one = client.responses.create(**run, conversation=conversation.id, input="What is my name?")
    two = client.responses.create(**run, conversation={"id": conversation.id}, input="Again.")
    # the second turn's prompt starts with the first's (its history, rendered the same way)
    assert two.usage.input_tokens_details.cached_tokens >= one.usage.input_tokens
    items = client.conversations.items.list(conversation.id, order="asc").data
    roles = [item.role for item in items]
    assert roles == ["user", "user", "assistant", "user", "assistant"]
    assert items[2].content[0].text == one.output_text and items[2].id == one.output[0].id
    page = client.conversations.items.list(conversation.id, limit=2)  # newest first
    assert [i.id for i in page.data] == [items[4].id, items[3].id] and page.has_more
    added = client.conversations.items.create(
        conversation.id, items=[{"type": "message", "role": "user", "content": "Extra."}]
    ).data
    assert client.conversations.items.retrieve(added[0].id, conversation_id=conversation.id)
    client.conversations.items.delete(added[0].id, conversation_id=conversation.id)
    assert len(client.conversations.items.list(conversation.id).data) == 5
    assert client.conversations.update(conversation.id, metadata={"t": "x"}).metadata == {"t": "x"}
    assert client.conversations.delete(conversation.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conversation.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(**run, conversation=conversation.id, input="x")


def test_bad_conversation_requests_get_4xx(live, client):
    url = live.v1 + "/conversations"
    conversation = client.conversations.create()
    many = [{"type": "message", "role": "user", "content": "x"}] * 21
    for method, path, body, status, param in [
        ("POST", "", {"items": many}, 400, "items"),
        ("POST", "", {"items": [{"type": "nope"}]}, 400, "items[0]"),
        ("POST", "", {"colour": 1}, 400, "colour"),
        ("POST", "", {"metadata": {"k": 1}}, 400, "metadata"),
        ("POST", f"/{conversation.id}", {}, 400, "metadata"),
        ("POST", f"/{conversation.id}/items", {"items": []}, 400, "items"),
        ("GET", f"/{conversation.id}/items?limit=0", None, 400, "limit"),
        ("GET", f"/{conversation.id}/items/msg_nope", None, 404, None),
        ("GET", "/conv_nope", None, 404, "conversation_id"),
        ("DELETE", "/conv_nope", None, 404, "conversation_id"),
    ]:  # fmt: skip
        response = httpx.request(method, url + path, json=body)
        assert response.status_code == status, (path, response.text)
        assert response.json()["error"]["param"] == param, path
    both = {"model": MODEL, "input": "x", "conversation": conversation.id,
            "previous_response_id": "resp_x"}  # fmt: skip
    response = httpx.post(live.v1 + "/responses", json=both)
    assert response.status_code == 400 and response.json()["error"]["param"] == "conversation"
