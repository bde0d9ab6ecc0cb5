"""Request-path defects of issue 15, through HTTP on the default model (httpx and the official
openai client): n with a seed, refusals before the first token, client request ids, unknown
fields, and logprob token strings, bytes and text offsets."""

from __future__ import annotations

import asyncio
import contextlib
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import orjson
import pytest

from tests.server.conftest import MODEL, LiveServer
from yaied.core.errors import InputError
from yaied.router.lifecycle import CallState

CHAT = [{"role": "user", "content": "Name a colour."}]
SMILE = "\U0001f642"  # two SmolLM2 tokens, b"\xf0\x9f" and b"\x99\x82": neither is UTF-8 alone

pytestmark = pytest.mark.timeout(120)


def manager_of(live: LiveServer):
    return live.server.config.app.state.server.manager


def sse_chunks(response: httpx.Response) -> list[dict]:
    lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [orjson.loads(line[6:]) for line in lines[:-1]]


# -- n > 1 with a seed --


def test_n_with_a_seed_gives_different_choices_and_the_same_response_again(live):
    body = {
        "prompt": "Once upon a time",
        "n": 4,
        "seed": 1234,
        "temperature": 1.0,
        "max_tokens": 12,
        "ignore_eos": True,
    }
    # Reproducible as far as the numbers are: bf16 logits computed over a cached prefix differ
    # in the last bits from a fresh prefill's, so the runs compared both find the prompt cached.
    httpx.post(live.v1 + "/completions", json=body, timeout=60)
    first = httpx.post(live.v1 + "/completions", json=body, timeout=60).json()
    texts = [c["text"] for c in first["choices"]]
    assert len(set(texts)) > 1, texts
    again = httpx.post(live.v1 + "/completions", json=body, timeout=60).json()
    assert [c["text"] for c in again["choices"]] == texts


def test_choice_i_of_each_prompt_runs_with_the_seed_plus_i(live):
    from yaied.server.protocol import parse_completion
    from yaied.server.serving import build_jobs

    parsed = parse_completion({"prompt": ["a", "b"], "n": 3, "seed": 10, "max_tokens": 2})
    jobs = build_jobs(manager_of(live), parsed, "key")
    assert [(j.prompt_index, j.params.seed) for j in jobs] == [
        (0, 10),
        (0, 11),
        (0, 12),
        (1, 10),
        (1, 11),
        (1, 12),
    ]
    unseeded = build_jobs(manager_of(live), parse_completion({"prompt": "a", "n": 2}), "key")
    assert [j.params.seed for j in unseeded] == [None, None]


def test_openai_chat_n_with_a_seed(live):
    client = openai.OpenAI(base_url=live.v1, api_key="none")
    ask = dict(model=MODEL, messages=CHAT, n=3, seed=7, temperature=1.0, max_tokens=10)
    client.chat.completions.create(**ask)  # the prompt cached for both runs compared
    first = client.chat.completions.create(**ask)
    texts = [c.message.content for c in first.choices]
    assert len(set(texts)) > 1, texts
    assert [c.message.content for c in client.chat.completions.create(**ask).choices] == texts


# -- refusals known before the first token --


@pytest.mark.parametrize("stream", [True, False])
def test_no_engine_for_the_call_is_a_503_before_streaming(live, monkeypatch, stream):
    handle = manager_of(live).handles["0"]
    # As a router whose only engines are remote daemons: none takes a call asking for logprobs.
    monkeypatch.setattr(handle, "supports", lambda params: params.logprobs is None)
    body = {"prompt": "Hi", "max_tokens": 4, "logprobs": 1, "stream": stream}
    with httpx.stream("POST", live.v1 + "/completions", json=body, timeout=30) as response:
        response.read()
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["code"] == "engine_not_ready" and error["type"] == "service_unavailable_error"
    assert "x-request-id" in response.headers
    monkeypatch.undo()
    assert httpx.post(live.v1 + "/completions", json=body, timeout=30).status_code == 200


def test_a_refused_second_choice_cancels_the_first(live, monkeypatch):
    manager = manager_of(live)
    start_call = manager.start_call
    calls = []

    def refuse_the_second(*args, **kwargs):
        calls.append(kwargs["request_id"])
        if len(calls) == 2:
            raise ValueError("top_k must be at least -1")  # any refusal at submission
        return start_call(*args, **kwargs)

    monkeypatch.setattr(manager, "start_call", refuse_the_second)
    body = {"prompt": "Hi", "n": 2, "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", live.v1 + "/completions", json=body, timeout=30) as response:
        response.read()
    assert response.status_code == 400 and response.json()["error"]["param"] == "top_k"
    deadline = time.monotonic() + 10
    while manager.num_requests_in_flight and time.monotonic() < deadline:
        time.sleep(0.02)
    assert manager.num_requests_in_flight == 0  # the first choice did not run on unread


@pytest.mark.parametrize("max_tokens", [5, 100])
def test_a_prompt_past_the_context_names_the_max_tokens_the_client_sent(live, max_tokens):
    body = {"prompt": "hello " * 1100, "max_tokens": max_tokens}  # past the 1024-token context
    r = httpx.post(live.v1 + "/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert f"plus max_tokens ({max_tokens})" in error["message"], error["message"]


async def test_the_calls_of_a_stream_that_never_started_are_cancelled():
    """Calls start before the response: if the client is gone before the headers go out, the
    stream is never read, and the response must still cancel them."""
    from tests.router.test_manager import started
    from yaied.server.app import build_app
    from yaied.server.config import ServerConfig
    from yaied.server.state import ServerState

    manager, _ = await started(1)  # fake engines: a token every 10 ms
    server = ServerState(ServerConfig(), "fake")
    server.manager = manager
    app = build_app(ServerConfig(), lambda: manager, "fake")
    body = orjson.dumps({"prompt": [1, 2], "max_tokens": 1000, "stream": True, "n": 2})
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        if messages:
            return messages.pop()
        await asyncio.sleep(0.05)
        return {"type": "http.disconnect"}

    async def send(message):
        raise OSError("the client is gone")

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
        "state": {"server": server},
    }
    with contextlib.suppress(Exception):
        await app(scope, receive, send)
    for _ in range(100):
        if manager.num_requests_in_flight == 0:
            break
        await asyncio.sleep(0.01)
    assert manager.num_requests_in_flight == 0
    assert [r.state.value for r in manager.lifecycle.by_state(CallState.CANCELLED)] == [
        "cancelled"
    ] * 2
    await manager.stop()


# -- client request ids --


def test_two_streams_with_the_same_request_id_both_complete(live):
    body = {"prompt": [1, 2, 3], "max_tokens": 32, "ignore_eos": True, "stream": True}

    def run() -> tuple[int, str, list[dict]]:
        headers = {"X-Request-Id": "same"}
        with httpx.stream(
            "POST", live.v1 + "/completions", json=body, headers=headers, timeout=30
        ) as r:
            return r.status_code, r.headers["x-request-id"], sse_chunks(r)

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: run(), range(2)))
    for status, header, chunks in results:
        assert status == 200 and header == "same"
        assert all("error" not in c for c in chunks), chunks
        assert {c["id"] for c in chunks} == {"same"}
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_openai_concurrent_requests_with_one_request_id(live):
    client = openai.AsyncOpenAI(base_url=live.v1, api_key="none")

    async def ask():
        stream = await client.completions.create(
            model=MODEL,
            prompt="The sky is",
            max_tokens=6,
            temperature=0,
            stream=True,
            extra_headers={"X-Request-Id": "dup-openai"},
            extra_body={"ignore_eos": True},
        )
        return [c async for c in stream]

    first, second = await asyncio.gather(ask(), ask())
    for chunks in (first, second):
        assert {c.id for c in chunks} == {"dup-openai"}
        assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in first) == "".join(c.choices[0].text for c in second)


def _stream_until_cancelled(live: LiveServer, request_id: str, n: int = 1):
    body = {"prompt": [4, 5, 6], "max_tokens": 900, "ignore_eos": True, "stream": True, "n": n}
    with httpx.stream(
        "POST",
        live.v1 + "/completions",
        json=body,
        headers={"X-Request-Id": request_id},
        timeout=60,
    ) as r:
        return sse_chunks(r)


def _finish_reasons(chunks: list[dict]) -> dict[int, str]:
    return {
        c["choices"][0]["index"]: c["choices"][0]["finish_reason"]
        for c in chunks
        if c["choices"] and c["choices"][0]["finish_reason"]
    }


def test_cancel_matches_the_client_id_exactly(live):
    manager = manager_of(live)
    with ThreadPoolExecutor(3) as pool:
        foo = pool.submit(_stream_until_cancelled, live, "foo", 2)
        foo3 = pool.submit(_stream_until_cancelled, live, "foo-3")
        deadline = time.monotonic() + 20
        while manager.num_requests_in_flight < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        records = manager.lifecycle.by_client_id("foo")
        assert len(records) == 2 and all(r.client_id == "foo" for r in records)
        assert len({r.request_id for r in records}) == 2
        cancelled = httpx.post(live.v1 + "/requests/foo/cancel", timeout=10).json()
        assert cancelled["cancelled"] == 2  # both choices of foo, nothing of foo-3
        assert _finish_reasons(foo.result(timeout=30)) == {0: "abort", 1: "abort"}
        assert not foo3.done()
        time.sleep(0.2)
        assert not foo3.done()
        assert httpx.post(live.v1 + "/requests/foo-3/cancel", timeout=10).json()["cancelled"] == 1
        assert _finish_reasons(foo3.result(timeout=30)) == {0: "abort"}
    assert httpx.post(live.v1 + "/requests/foo/cancel", timeout=10).status_code == 404


def test_cancel_reaches_every_request_with_that_client_id(live):
    manager = manager_of(live)
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(_stream_until_cancelled, live, "twice") for _ in range(2)]
        deadline = time.monotonic() + 20
        while manager.num_requests_in_flight < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert httpx.post(live.v1 + "/requests/twice/cancel").json()["cancelled"] == 2
        assert [_finish_reasons(f.result(timeout=30)) for f in futures] == [{0: "abort"}] * 2


def test_cancel_works_while_the_server_drains(live):
    """A stop lets in-flight calls run out their grace: a client or operator who gives up on one
    then must still be able to cancel it (and its session), not meet the drain's 503."""
    manager = manager_of(live)
    state = live.server.config.app.state.server
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(_stream_until_cancelled, live, "in-drain")
        deadline = time.monotonic() + 20
        while manager.num_requests_in_flight < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        state.draining = True
        try:
            refused = httpx.post(live.v1 + "/completions", json={"prompt": "x", "max_tokens": 1})
            assert refused.status_code == 503  # new work is refused
            cancelled = httpx.post(live.v1 + "/requests/in-drain/cancel", timeout=10)
            assert cancelled.status_code == 200, cancelled.text
            assert cancelled.json()["cancelled"] == 1
            session = httpx.post(live.v1 + "/sessions/nobody/cancel", timeout=10)
            assert session.status_code == 200 and session.json()["cancelled"] == 0
        finally:
            state.draining = False
        assert _finish_reasons(running.result(timeout=30)) == {0: "abort"}


# -- request fields --

UNKNOWN = [
    ("/completions", {"prompt": "x", "frobnicate": 1}, "frobnicate", "Unrecognized"),
    ("/chat/completions", {"messages": CHAT, "frobnicate": 1}, "frobnicate", "Unrecognized"),
    # Malformed constraints (those that do not compile: tests/server/test_structured_http.py).
    ("/chat/completions", {"messages": CHAT, "guided_json": 3}, "guided_json", "JSON object"),
    (
        "/completions",
        {"prompt": "x", "response_format": {"type": "xml"}},
        "response_format.type",
        "response_format.type must be",
    ),
    ("/completions", {"prompt": "x", "store": True}, "store", "Unrecognized"),  # chat only
    (
        "/chat/completions",
        {"messages": CHAT, "chat_template_kwargs": {"tokenize": True}},
        "chat_template_kwargs.tokenize",
        "chat_template_kwargs",
    ),
]


@pytest.mark.parametrize("path, body, param, words", UNKNOWN)
def test_unknown_and_unsupported_fields_are_400s_naming_them(live, path, body, param, words):
    for stream in (False, True):
        r = httpx.post(live.v1 + path, json={**body, "stream": stream, "max_tokens": 2})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and words in error["message"]
        assert error["type"] == "invalid_request_error"


def test_openai_fields_that_change_nothing_are_accepted(live):
    client = openai.OpenAI(base_url=live.v1, api_key="none")
    out = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_completion_tokens=3,
        temperature=0,
        store=False,
        metadata={"team": "a"},
        service_tier="auto",
        user="someone",
        parallel_tool_calls=False,
        prompt_cache_key="k",
        safety_identifier="s",
        response_format={"type": "text"},
    )
    assert out.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=2, extra_body={"frobnicate": 1}
        )
    assert info.value.body["param"] == "frobnicate"
    with pytest.raises(openai.BadRequestError, match="non-empty list") as info:
        client.completions.create(
            model=MODEL, prompt="x", max_tokens=2, extra_body={"guided_choice": []}
        )
    assert info.value.body["param"] == "guided_choice"


def test_add_generation_prompt_and_chat_template_kwargs_are_honoured(live):
    body = {"messages": CHAT, "max_tokens": 1, "temperature": 0}
    on = httpx.post(live.v1 + "/chat/completions", json=body).json()
    off = httpx.post(
        live.v1 + "/chat/completions", json={**body, "add_generation_prompt": False}
    ).json()
    # The assistant's turn that SmolLM2's template adds at the end.
    turn = manager_of(live).tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert on["usage"]["prompt_tokens"] - off["usage"]["prompt_tokens"] == len(turn)
    # The default template reads no extra variable: accepted, same prompt.
    kw = httpx.post(
        live.v1 + "/chat/completions",
        json={**body, "chat_template_kwargs": {"enable_thinking": False}},
    ).json()
    assert kw["usage"]["prompt_tokens"] == on["usage"]["prompt_tokens"]
    counted = httpx.post(
        live.url + "/tokenize", json={"messages": CHAT, "add_generation_prompt": False}
    ).json()
    assert counted["count"] == off["usage"]["prompt_tokens"]


def test_continue_final_message_continues_the_last_message(live):
    prefilled = [*CHAT, {"role": "assistant", "content": "My favourite colour is"}]
    body = {"messages": prefilled, "max_tokens": 8, "temperature": 0}
    chat = httpx.post(
        live.v1 + "/chat/completions", json={**body, "continue_final_message": True}
    ).json()
    rendered = httpx.post(
        live.url + "/tokenize", json={"messages": prefilled, "continue_final_message": True}
    ).json()
    # The prompt ends inside the assistant's message: no end of its turn, no new turn.
    text = manager_of(live).tokenizer.decode(rendered["tokens"])
    assert text.endswith("<|im_start|>assistant\nMy favourite colour is")
    assert chat["usage"]["prompt_tokens"] == rendered["count"]
    # The answer is what follows that text, and only that.
    completion = httpx.post(
        live.v1 + "/completions",
        json={"prompt": rendered["tokens"], "max_tokens": 8, "temperature": 0},
    ).json()
    assert chat["choices"][0]["message"]["content"] == completion["choices"][0]["text"]
    closed = httpx.post(live.v1 + "/chat/completions", json=body).json()  # a turn of its own
    assert closed["usage"]["prompt_tokens"] > chat["usage"]["prompt_tokens"]


def test_a_template_that_drops_the_last_message_cannot_continue_it(live):
    inputs = manager_of(live).inputs
    prefilled = [*CHAT, {"role": "assistant", "content": "Blue"}]
    first_only = "{{ messages[0]['content'] }}"
    with pytest.raises(InputError, match="cannot be continued"):
        inputs.chat_prompt(prefilled, first_only, continue_final_message=True)
    both = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    assert inputs.chat_prompt(prefilled, both, continue_final_message=True)[1] == (
        "[Name a colour.][Blue"
    )


def test_chat_template_kwargs_reach_the_template(live):
    inputs = manager_of(live).inputs
    template = "{% if shout %}LOUD {% endif %}{{ messages[0]['content'] }}"
    assert inputs.chat_prompt(CHAT, template)[1] == "Name a colour."
    loud = inputs.chat_prompt(CHAT, template, template_kwargs={"shout": True})[1]
    assert loud == "LOUD Name a colour."


# -- logprob token strings, bytes and offsets --


def test_echo_logprobs_of_a_split_character(live):
    body = {"prompt": f"{SMILE} hi", "max_tokens": 1, "echo": True, "logprobs": 2}
    out = httpx.post(live.v1 + "/completions", json=body).json()
    choice = out["choices"][0]
    lp = choice["logprobs"]
    assert lp["tokens"][:3] == ["bytes:\\xf0\\x9f", "bytes:\\x99\\x82", " hi"]
    assert lp["text_offset"][:3] == [0, 0, 1]  # the smile completes with the second token
    text = choice["text"]
    # The prompt's whole-character tokens sit at their offsets (the sampled token, last, may
    # itself be part of a character, named by its bytes).
    for token, offset in zip(lp["tokens"][2:-1], lp["text_offset"][2:-1], strict=True):
        assert text[offset:].startswith(token)
    assert lp["text_offset"][3] == len(f"{SMILE} hi")
    assert lp["top_logprobs"][0] is None and lp["tokens"][1] in lp["top_logprobs"][1]


def test_chat_logprobs_carry_the_real_bytes_of_a_split_character(live):
    client = openai.OpenAI(base_url=live.v1, api_key="none")
    first_half = 10813  # b"\xf0\x9f"
    out = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=1,
        temperature=0,
        logprobs=True,
        top_logprobs=1,
        logit_bias={str(first_half): 100},
    )
    content = out.choices[0].logprobs.content
    assert content[0].token == "bytes:\\xf0\\x9f" and content[0].bytes == [0xF0, 0x9F]
    top = content[0].top_logprobs[0]  # of the raw distribution, before the bias: a whole word
    assert bytes(top.bytes).decode() == top.token
    joined = bytes(b for item in content for b in item.bytes)
    assert joined.decode("utf-8", "replace") == out.choices[0].message.content


def test_streamed_completion_offsets_follow_the_text(live):
    body = {
        "prompt": "Write a word:",
        "max_tokens": 12,
        "logprobs": 0,
        "stream": True,
        "temperature": 0,
        "ignore_eos": True,
    }
    with httpx.stream("POST", live.v1 + "/completions", json=body, timeout=30) as r:
        chunks = sse_chunks(r)
    text, tokens, offsets = "", [], []
    for c in chunks:
        choice = c["choices"][0]
        text += choice["text"]
        if choice["logprobs"]:
            tokens += choice["logprobs"]["tokens"]
            offsets += choice["logprobs"]["text_offset"]
    assert len(tokens) == 12 and offsets == sorted(offsets) and offsets[0] == 0
    for token, offset in zip(tokens, offsets, strict=True):
        if not token.startswith("bytes:"):
            assert text[offset:].startswith(token), (token, offset, text)
