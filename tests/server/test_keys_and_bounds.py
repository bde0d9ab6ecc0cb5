"""The pieces of issue 19 that need no server: the key table, header-safe ids, the stop-string
matcher's bounds and cost, tiny temperatures, and the queue counted in calls."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from yaied.core.detokenizer import _StopMatcher
from yaied.core.ids import MAX_ID_CHARS, header_safe
from yaied.core.request import SamplingParams
from yaied.server.config import ServerConfig
from yaied.server.errors import APIError, public_error
from yaied.server.keys import ApiKey, KeyTable, scoped_id
from yaied.server.state import ServerState


def test_key_table_entries_defaults_and_errors():
    table = KeyTable.parse(
        ["sk-plain", "# a comment", "", "sk-a= name=alice admin=true may_set_priority=true"]
        + ["sk-b name=bob max_in_flight=4"]
    )
    plain, alice, bob = table.keys
    assert plain == ApiKey("key1", "sk-plain")  # the older format: no rights beyond the API
    assert alice.admin and alice.may_set_priority and alice.secret == "sk-a="
    assert bob.max_in_flight == 4 and not bob.may_set_priority
    assert table.lookup(b"sk-b") is bob and table.lookup(b"sk-") is None
    assert "sk-a" not in repr(alice)  # secrets stay out of logs
    assert scoped_id(bob, "x") == "bob:x" and scoped_id(None, "x") == "x"
    for bad in ("k admin=yes", "k name=a:b", "k max_in_flight=-1", "k colour=red", "k nonsense"):
        with pytest.raises(ValueError) as info:
            KeyTable.parse([bad])
        assert "k " not in str(info.value).split(":")[0]  # names the entry, not the secret
    with pytest.raises(ValueError, match="share a name"):
        KeyTable.parse(["a name=x", "b name=x"])
    with pytest.raises(ValueError):
        ServerConfig(api_keys=("k admin=maybe",))


def test_key_file_holds_the_same_entries(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# name per key\nsk-1 name=ops admin=true\nsk-2\n")
    config = ServerConfig(api_key_file=str(path))
    assert [k.name for k in KeyTable.parse(config.api_keys).keys] == ["ops", "key2"]


def test_header_safe_ids():
    assert header_safe("chat-42_a.b~c") == "chat-42_a.b~c"
    for value in ("Jürgen 🚀", "a\r\nX-Injected: 1", "100%", "x" * 5000, "ü" * 256):
        safe = header_safe(value)
        assert safe.isascii() and safe.isprintable() and len(safe) <= MAX_ID_CHARS
        assert "\r" not in safe and "\n" not in safe and " " not in safe
        assert header_safe(value) == safe  # stable: one session stays one session
    assert header_safe("%41") != header_safe("A")
    assert header_safe("ü" * 300) != header_safe("ü" * 301)


def naive_stop(text_pieces: list[str], stops: list[str]) -> tuple[str, str | None]:
    """The reference: the earliest-ending occurrence (ties: the longest) over the whole text."""
    text = "".join(text_pieces)
    best = None
    for stop in stops:
        start = text.find(stop)
        if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
            best = (start + len(stop), start, stop)
    return (text, None) if best is None else (text[: best[1]], best[2])


def test_stop_matcher_agrees_with_the_reference_however_the_text_is_split():
    rng = random.Random(0)
    for _ in range(400):
        stops = ["".join(rng.choices("ab", k=rng.randint(1, 5))) for _ in range(rng.randint(1, 4))]
        text = "".join(rng.choices("abc", k=rng.randint(0, 30)))
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        matcher, out, stop = _StopMatcher(stops, include=False), [], None
        for i, piece in enumerate(pieces):
            delta, stop = matcher.feed(piece, final=i == len(pieces) - 1)
            out.append(delta)
            if stop is not None:
                break
        assert ("".join(out), stop) == naive_stop(pieces, stops), (stops, pieces)


def test_stop_strings_and_ids_are_bounded_and_tiny_temperatures_greedy():
    SamplingParams(stop=["a" * 256] * 16)
    for stop in (["a"] * 17, ["a" * 257]):
        with pytest.raises(ValueError, match="^stop"):
            SamplingParams(stop=stop)
    with pytest.raises(ValueError, match="^stop_token_ids"):
        SamplingParams(stop_token_ids=list(range(257)))
    assert SamplingParams(stop_token_ids=[5, 3, 5]).stop_token_ids == (5, 3)
    assert SamplingParams(temperature=1e-30).greedy and SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=1e-3).greedy


def test_public_error_keeps_engine_words_and_drops_exception_text():
    words = "the engine stopped: a step ran past engine.step_timeout_s"
    assert public_error("generation failed", words, "r1") == f"generation failed: {words}"
    for internal in (
        "RuntimeError: boom",
        "ConnectError('x')",
        "Traceback (most recent call last)",
    ):
        message = public_error("generation failed", internal, "r1")
        assert internal not in message and "r1" in message


def test_the_queue_counts_calls_and_takes_a_request_when_empty():
    state = ServerState(ServerConfig(max_queue_len=8), "m")
    state.check_queue(SimpleNamespace(num_calls_waiting=0), 100)  # an empty queue takes any
    state.check_queue(SimpleNamespace(num_calls_waiting=4), 4)
    with pytest.raises(APIError) as info:
        state.check_queue(SimpleNamespace(num_calls_waiting=4), 5)
    assert info.value.status == 429 and info.value.headers["Retry-After"] == "1"
    state.cpu_pool.shutdown()


def test_a_draining_server_refuses_with_retry_after():
    # SIGTERM: new requests and /health get 503; a client or balancer is told when to retry
    # (elsewhere, or here once a supervisor has restarted the daemon), as for a dead engine.
    state = ServerState(ServerConfig(retry_after_seconds=3), "m")
    state.manager = SimpleNamespace(dead=None)
    state.draining = True
    with pytest.raises(APIError) as info:
        state.ready_manager()
    assert info.value.status == 503 and info.value.code == "draining"
    assert info.value.headers == {"Retry-After": "3"}
    state.cpu_pool.shutdown()


def test_a_warning_when_listening_beyond_loopback_without_keys(caplog):
    from yaied.daemon import warn_if_exposed

    assert not warn_if_exposed(ServerConfig(host="127.0.0.1"))
    assert not warn_if_exposed(ServerConfig(host="0.0.0.0", api_keys=("sk-1",)))
    assert warn_if_exposed(ServerConfig(host="0.0.0.0")) and "without API keys" in caplog.text
