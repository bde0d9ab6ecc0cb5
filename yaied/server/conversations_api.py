"""``/v1/conversations``: OpenAI's Conversations API, the stateful item lists that
``/v1/responses`` runs in with ``conversation`` (the Agents SDK's sessions and
``conversation_id``).

    POST   /v1/conversations                        create (``items``: at most 20, ``metadata``)
    GET    /v1/conversations/{id}                   the conversation object
    POST   /v1/conversations/{id}                   update its ``metadata``
    DELETE /v1/conversations/{id}
    GET    /v1/conversations/{id}/items             its items, a page at a time
    POST   /v1/conversations/{id}/items             append ``items`` (at most 20)
    GET    /v1/conversations/{id}/items/{item_id}
    DELETE /v1/conversations/{id}/items/{item_id}   returns the conversation

Conversations live in the response store (response_store.py): the same LRU, bounds and per-key
namespaces, so one key never sees another's. Items are checked and shaped as a response's input
items are (responses_protocol.parse_items), and get an id where the client sent none. A
response run with ``conversation`` reads the items first and, once it has completed (or stopped
at its token limit), appends its input and output items (responses_api.py).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from yaied.server.body import read_json
from yaied.server.errors import APIError, json_response
from yaied.server.protocol import _refuse_unknown_fields
from yaied.server.response_store import StoredConversation
from yaied.server.responses_api import _namespace, _store, page_of
from yaied.server.responses_protocol import _metadata, parse_items
from yaied.server.responses_running import with_ids

MAX_ITEMS_PER_CALL = 20  # OpenAI's bound on items a create or an append carries


def routes() -> list[Route]:
    base = "/v1/conversations"
    return [
        Route(base, create_conversation, methods=["POST"]),
        Route(base + "/{conversation_id}", get_conversation, methods=["GET"]),
        Route(base + "/{conversation_id}", update_conversation, methods=["POST"]),
        Route(base + "/{conversation_id}", delete_conversation, methods=["DELETE"]),
        Route(base + "/{conversation_id}/items", list_items, methods=["GET"]),
        Route(base + "/{conversation_id}/items", add_items, methods=["POST"]),
        Route(base + "/{conversation_id}/items/{item_id}", get_item, methods=["GET"]),
        Route(base + "/{conversation_id}/items/{item_id}", delete_item, methods=["DELETE"]),
    ]


async def create_conversation(request: Request) -> Response:
    body = await read_json(request)
    _refuse_unknown_fields(body, frozenset({"items", "metadata"}))
    items = _items(body.get("items") or [])
    conversation = StoredConversation.make(
        "conv_" + uuid.uuid4().hex, int(time.time()), _metadata(body), tuple(items)
    )
    _keep(request, conversation)
    return json_response(conversation.body())


async def get_conversation(request: Request) -> Response:
    return json_response(_conversation(request).body())


async def update_conversation(request: Request) -> Response:
    old = _conversation(request)
    body = await read_json(request)
    _refuse_unknown_fields(body, frozenset({"metadata"}))
    if "metadata" not in body:
        raise APIError(400, "metadata is required", param="metadata")
    new = old.changed(metadata=_metadata(body))
    _keep(request, new)
    return json_response(new.body())


async def delete_conversation(request: Request) -> Response:
    conversation = _conversation(request)
    _store(request).delete(_namespace(request), conversation.id, StoredConversation)
    return json_response({"id": conversation.id, "object": "conversation.deleted", "deleted": True})


async def list_items(request: Request) -> Response:
    """``limit`` (1-100, default 20), ``order`` (``desc`` by default), ``after`` an item id;
    ``include`` accepted."""
    conversation = _conversation(request)
    return json_response(page_of(list(conversation.items), request, conversation.id))


async def add_items(request: Request) -> Response:
    old = _conversation(request)
    body = await read_json(request)
    _refuse_unknown_fields(body, frozenset({"items"}))
    items = _items(body.get("items"))
    if not items:
        raise APIError(400, "items must be a non-empty list", param="items")
    _keep(request, old.changed(items=(*old.items, *items)))
    return json_response({"object": "list", "data": items, "first_id": items[0]["id"],
                          "last_id": items[-1]["id"], "has_more": False})  # fmt: skip


async def get_item(request: Request) -> Response:
    conversation, item_id = _conversation(request), request.path_params["item_id"]
    for item in conversation.items:
        if item["id"] == item_id:
            return json_response(item)
    raise APIError(404, f"no item {item_id!r} in {conversation.id!r}", code="item_not_found")


async def delete_item(request: Request) -> Response:
    old, item_id = _conversation(request), request.path_params["item_id"]
    items = tuple(item for item in old.items if item["id"] != item_id)
    if len(items) == len(old.items):
        raise APIError(404, f"no item {item_id!r} in {old.id!r}", code="item_not_found")
    new = old.changed(items=items)
    _keep(request, new)
    return json_response(new.body())


def _conversation(request: Request) -> StoredConversation:
    conversation_id = request.path_params["conversation_id"]
    found = _store(request).get_conversation(_namespace(request), conversation_id)
    if found is None:
        text = f"no conversation {conversation_id!r}"
        raise APIError(404, text, param="conversation_id", code="conversation_not_found")
    return found


def _items(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or len(value) > MAX_ITEMS_PER_CALL:
        raise APIError(400, f"items is a list of at most {MAX_ITEMS_PER_CALL} items", "items")
    _, items = parse_items(value, where="items")
    return with_ids(items)


def _keep(request: Request, conversation: StoredConversation) -> None:
    if not _store(request).put(_namespace(request), conversation):
        text = "the conversation is larger than the store holds"
        raise APIError(413, text, param="items", code="conversation_too_large")
