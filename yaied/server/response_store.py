"""Stored Responses (``/v1/responses`` with ``store``): what ``previous_response_id`` continues
and ``GET /v1/responses/{id}`` returns.

A bounded LRU map, in the server's memory only (a restart forgets every response, as a
``previous_response_id`` that is not found says). Both bounds hold after every ``put``: the
number of responses and the bytes of their conversations and bodies, so a client that chains
turns forever, or stores huge ones, pushes out the least recently used, never the daemon's
memory. Keys are ``(namespace, id)``, the namespace being the caller's API key name (keys.py),
so one key never reads, continues or deletes another's responses: to it they do not exist.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import orjson


@dataclass(frozen=True, slots=True)
class StoredResponse:
    id: str
    # The whole conversation up to and including this response's output, as chat messages:
    # what the next turn's prompt is rendered from (so its prefix is the cached one).
    messages: tuple[dict[str, Any], ...]
    body: dict[str, Any]  # the response object as GET returns it
    chain_id: str  # the first response of the chain: the session the router pins it under
    instructions: str | None = None  # not carried over (OpenAI's rule), kept for GET only
    size: int = 0  # bytes counted against the store's bound
    # this turn's input as Responses items, with ids: what GET .../input_items lists
    input_items: tuple[dict[str, Any], ...] = ()
    # its items by id, built by the first ``item`` call (the response never changes once stored)
    by_id: dict[str, dict[str, Any]] = field(default_factory=dict, compare=False, repr=False)

    @staticmethod
    def make(
        id: str,
        messages: list[dict[str, Any]],
        body: dict[str, Any],
        chain_id: str,
        input_items: list[dict[str, Any]] | None = None,
    ) -> StoredResponse:
        items = tuple(input_items or ())
        size = sum(len(orjson.dumps(part)) for part in (messages, body, items))
        return StoredResponse(id, tuple(messages), body, chain_id, size=size, input_items=items)

    def item(self, item_id: str) -> dict[str, Any] | None:
        """A copy of this response's input or output item with that id (the first listed). A
        request may name each of thousands of items: one scan builds the index they all use."""
        if not self.by_id:
            for item in (*self.input_items, *self.body.get("output", ())):
                if isinstance(item.get("id"), str):
                    self.by_id.setdefault(item["id"], item)
        found = self.by_id.get(item_id)
        return None if found is None else dict(found)


@dataclass(frozen=True, slots=True)
class StoredConversation:
    """A conversation (``/v1/conversations``): its items in Responses' shape, each with an id;
    the responses run in it append their input and output. Replaced whole on every change."""

    id: str
    created_at: int
    metadata: dict[str, str]
    items: tuple[dict[str, Any], ...] = ()
    size: int = 0

    @staticmethod
    def make(
        id: str, created_at: int, metadata: dict[str, str], items: tuple[dict[str, Any], ...]
    ) -> StoredConversation:
        size = len(orjson.dumps([metadata, items]))
        return StoredConversation(id, created_at, dict(metadata), tuple(items), size)

    def changed(
        self,
        *,
        metadata: dict[str, str] | None = None,
        items: tuple[dict[str, Any], ...] | None = None,
    ) -> StoredConversation:
        """This conversation with new metadata or items (its size counted again)."""
        return StoredConversation.make(
            self.id,
            self.created_at,
            self.metadata if metadata is None else metadata,
            self.items if items is None else items,
        )

    def body(self) -> dict[str, Any]:
        return {"id": self.id, "object": "conversation", "created_at": self.created_at,
                "metadata": self.metadata}  # fmt: skip


class ResponseStore:
    """LRU over (namespace, id), bounded by ``max_count`` and ``max_bytes``. Event-loop only.
    Conversations share the map and its bounds (their ids, ``conv_``, never meet a response's)."""

    def __init__(self, max_count: int, max_bytes: int) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self.num_evicted = 0
        self._items: OrderedDict[tuple[str, str], StoredResponse | StoredConversation] = (
            OrderedDict()
        )

    def __len__(self) -> int:
        return len(self._items)

    def get(self, namespace: str, response_id: str) -> StoredResponse | None:
        item = self._get(namespace, response_id)
        return item if isinstance(item, StoredResponse) else None

    def item(self, namespace: str, item_id: str) -> dict[str, Any] | None:
        """A copy of the stored item an ``item_reference`` names: an item's id names its
        response (``<kind>_<the response id's hex>_<n>``, responses_output.py)."""
        response_suffix = item_id.partition("_")[2].rpartition("_")[0]
        stored = self.get(namespace, "resp_" + response_suffix) if response_suffix else None
        return None if stored is None else stored.item(item_id)

    def get_conversation(self, namespace: str, conversation_id: str) -> StoredConversation | None:
        item = self._get(namespace, conversation_id)
        return item if isinstance(item, StoredConversation) else None

    def _get(self, namespace: str, key_id: str) -> StoredResponse | StoredConversation | None:
        key = (namespace, key_id)
        item = self._items.get(key)
        if item is not None:
            self._items.move_to_end(key)  # read or continued: recently used
        return item

    def put(self, namespace: str, item: StoredResponse | StoredConversation) -> bool:
        """Keep ``item``; False when it alone is over the byte bound (then nothing is kept)."""
        if item.size > self.max_bytes or self.max_count == 0:
            return False
        self.delete(namespace, item.id, type(item))
        self._items[(namespace, item.id)] = item
        self.num_bytes += item.size
        while len(self._items) > self.max_count or self.num_bytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.num_bytes -= old.size
            self.num_evicted += 1
        return True

    def delete(self, namespace: str, response_id: str, kind: type = StoredResponse) -> bool:
        """Remove the ``kind`` (a response, or StoredConversation) stored under that id."""
        if not isinstance(self._items.get((namespace, response_id)), kind):
            return False
        item = self._items.pop((namespace, response_id))
        self.num_bytes -= item.size
        return True
