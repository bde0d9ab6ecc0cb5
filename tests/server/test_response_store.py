"""The stored responses' bounds: count, bytes, least recently used first, one namespace per key."""

from __future__ import annotations

import pytest

from yaied.server.response_store import ResponseStore, StoredResponse


def item(name: str, text: str = "x") -> StoredResponse:
    return StoredResponse.make(name, [{"role": "user", "content": text}], {"id": name}, name)


def test_count_bound_drops_the_least_recently_used():
    store = ResponseStore(max_count=2, max_bytes=1 << 20)
    for name in ("a", "b"):
        store.put("", item(name))
    store.get("", "a")  # a is now the most recent
    store.put("", item("c"))
    assert store.get("", "b") is None and store.get("", "a") and store.get("", "c")
    assert len(store) == 2 and store.num_evicted == 1


def test_byte_bound_holds_after_every_put():
    store = ResponseStore(max_count=1000, max_bytes=2000)
    for i in range(100):
        assert store.put("", item(f"r{i}", "y" * 300))
        assert store.num_bytes <= 2000
    assert len(store) < 10 and store.get("", "r99") is not None
    assert not store.put("", item("huge", "z" * 5000))  # alone over the bound: not kept
    assert store.get("", "r99") is not None  # and nothing else was pushed out for it


def test_namespaces_never_meet():
    store = ResponseStore(max_count=10, max_bytes=1 << 20)
    store.put("alice", item("r1"))
    assert store.get("bob", "r1") is None and not store.delete("bob", "r1")
    assert store.get("alice", "r1") is not None
    assert store.delete("alice", "r1") and store.num_bytes == 0


@pytest.mark.timeout(10)
def test_every_item_of_a_long_response_is_found_in_linear_time():
    """A request may reference each of a stored response's thousands of items (Codex sends its
    items back). Each lookup scanned and copied the whole list: looking up 60,000 held the event
    loop for minutes. An index makes it a fraction of a second."""
    count = 60_000
    items = [{"id": f"msg_abc_in{i}", "type": "message", "n": i} for i in range(count)]
    body = {"id": "resp_abc", "output": [{"id": "msg_abc_0", "type": "message"}]}
    stored = StoredResponse.make("resp_abc", [], body, "resp_abc", items)
    store = ResponseStore(max_count=10, max_bytes=1 << 30)
    store.put("alice", stored)
    for i in range(count):
        found = store.item("alice", f"msg_abc_in{i}")
        assert found == items[i] and found is not items[i]  # a copy
    assert store.item("alice", "msg_abc_0")["id"] == "msg_abc_0"
    assert store.item("alice", "msg_abc_in99999") is None
    assert store.item("bob", "msg_abc_in0") is None  # another key's
    assert store.item("alice", "noprefix") is None
