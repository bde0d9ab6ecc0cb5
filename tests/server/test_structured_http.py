"""Structured outputs over HTTP on the default model: response_format, structured_outputs and the
guided_* aliases on both endpoints, streamed and not, n = 2; the 400s of specs that do not
compile (nothing queued); a compile past the timeout; a client gone while its grammar compiles;
the official openai client's parse(); the compile and mask metrics."""

from __future__ import annotations

import json
import re
import threading
import time
from typing import Any, Literal

import httpx
import jsonschema
import openai
import orjson
import pydantic
import pytest

from tests.server.conftest import MODEL, LiveServer
from tests.structured.schemas import SCHEMA_CASES, example_messages
from tests.waiting import wait_until
from yaied.structured import GrammarCompiler

pytestmark = pytest.mark.timeout(180)

CASES = {case.name: case for case in SCHEMA_CASES}


def manager_of(live: LiveServer):
    return live.server.config.app.state.server.manager


def chat_body(case_name: str, **extra: Any) -> dict[str, Any]:
    case = CASES[case_name]
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": case_name, "schema": case.schema, "strict": True},
    }
    return {
        "messages": example_messages(case),
        "response_format": response_format,
        "max_tokens": 256,
        "temperature": 0,
        **extra,
    }


def sse_text(response: httpx.Response) -> tuple[str, str | None]:
    """The streamed content and the finish reason of a one-choice chat stream."""
    text, finish = [], None
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            choice = orjson.loads(line[6:])["choices"][0]
            text.append(choice["delta"].get("content", ""))
            finish = choice["finish_reason"] or finish
    return "".join(text), finish


def test_chat_json_schema_streamed_and_not(live):
    for name in ("order", "pydantic_user_with_address_ref", "shape_tagged_union"):
        body = chat_body(name)
        # Both compared requests find the prompt's pages cached: the first request of a prompt
        # computes all of it, later ones only the tail past the cached pages, and in bf16
        # oneDNN's matmul of a short tail can differ in a last bit from the same rows in the
        # whole prompt's (docs/architecture.md), which may flip a near-tie in greedy output.
        httpx.post(live.v1 + "/chat/completions", json=body, timeout=120)
        out = httpx.post(live.v1 + "/chat/completions", json=body, timeout=120).json()
        choice = out["choices"][0]
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), CASES[name].schema)
        with httpx.stream(
            "POST", live.v1 + "/chat/completions", json={**body, "stream": True}, timeout=120
        ) as response:
            streamed, finish = sse_text(response)
        assert (streamed, finish) == (choice["message"]["content"], "stop")


def test_completions_take_every_form_of_constraint(live):
    prompt = "Q: Is the sky green? Answer yes or no.\nA:"
    forms = [
        ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
        ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
        ({"guided_regex": r"(yes|no)\."}, lambda t: re.fullmatch(r"(yes|no)\.", t)),
        ({"structured_outputs": {"regex": r"[a-z]{2,5}"}}, lambda t: re.fullmatch("[a-z]{2,5}", t)),
        ({"guided_grammar": 'root ::= "yes" | "no"'}, lambda t: t in ("yes", "no")),
        ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
        ({"structured_outputs": {"json_object": True}}, lambda t: isinstance(json.loads(t), dict)),
        (
            {"guided_json": {"type": "object", "properties": {"a": {"type": "boolean"}}}},
            lambda t: isinstance(json.loads(t), dict),
        ),
    ]
    for extra, check in forms:
        body = {"prompt": prompt, "max_tokens": 48, "temperature": 0, **extra}
        choice = httpx.post(live.v1 + "/completions", json=body, timeout=60).json()["choices"][0]
        assert choice["finish_reason"] == "stop" and check(choice["text"]), (extra, choice)


def test_n_2_gives_each_choice_its_own_matcher(live):
    body = chat_body("person", n=2, seed=11, temperature=1.0)
    out = httpx.post(live.v1 + "/chat/completions", json=body, timeout=120).json()
    contents = [c["message"]["content"] for c in out["choices"]]
    assert [c["finish_reason"] for c in out["choices"]] == ["stop", "stop"]
    for content in contents:
        jsonschema.validate(json.loads(content), CASES["person"].schema)
    assert contents[0] != contents[1]


INVALID = [
    ({"guided_regex": "(unclosed"}, "guided_regex", "invalid regular expression"),
    (
        {"structured_outputs": {"grammar": 'root ::= "a" |'}},
        "structured_outputs.grammar",
        "grammar",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "odd"}}}},
        "response_format.json_schema.schema",
        "invalid JSON schema",
    ),
    ({"guided_regex": "a" * 70_000}, "guided_regex", "over the limit"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, None, "only one"),
]


@pytest.mark.parametrize("extra, param, words", INVALID)
@pytest.mark.parametrize("path", ["/completions", "/chat/completions"])
def test_a_spec_that_does_not_compile_is_a_400_naming_it(live, path, extra, param, words):
    manager = manager_of(live)
    before = len(manager.lifecycle)
    base = {"prompt": "x"} if path == "/completions" else {"messages": [{"role": "user"}]}
    for stream in (False, True):
        body = {**base, **extra, "max_tokens": 4, "stream": stream}
        response = httpx.post(live.v1 + path, json=body, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert words in error["message"] and error["type"] == "invalid_request_error"
        if param is not None:
            assert error["param"] == param
    assert len(manager.lifecycle) == before  # nothing was queued


def test_resume_token_ids_the_grammar_refuses_are_a_400(live):
    """A moved call's tokens are replayed through its grammar: ones it refuses are bad input, a
    400 naming resume_token_ids before anything is queued, not a 500 or an error event."""
    manager = manager_of(live)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    base = {"prompt": "JSON:", "max_tokens": 24, "temperature": 0, "guided_json": schema}
    full = httpx.post(live.v1 + "/completions", json=base, timeout=60).json()["choices"][0]
    sent = manager.tokenizer.encode(full["text"][:4], add_special_tokens=False)
    body = {**base, "resume_token_ids": sent}
    resumed = httpx.post(live.v1 + "/completions", json=body, timeout=60)
    choice = resumed.json()["choices"][0]
    assert resumed.status_code == 200 and choice["finish_reason"] == "stop"
    before = len(manager.lifecycle)
    refused = manager.tokenizer.encode("hello", add_special_tokens=False)
    for stream in (False, True):
        body = {**base, "resume_token_ids": refused, "stream": stream}
        response = httpx.post(live.v1 + "/completions", json=body, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "resume_token_ids" and "not allowed" in error["message"]
    assert len(manager.lifecycle) == before  # nothing was queued
    body = {**base, "resume_token_ids": [10**9]}
    error = httpx.post(live.v1 + "/completions", json=body, timeout=60).json()["error"]
    assert error["param"] == "resume_token_ids"


@pytest.fixture
def slow_compiles(monkeypatch):
    """Every compile takes at least a second more (in its compile thread)."""
    compile_uncached = GrammarCompiler._compile_uncached

    def slow(self, spec):
        time.sleep(1.0)
        return compile_uncached(self, spec)

    monkeypatch.setattr(GrammarCompiler, "_compile_uncached", slow)


def test_a_compile_past_the_timeout_is_a_400(live, slow_compiles, monkeypatch):
    grammars = manager_of(live).inputs.grammars
    body = {"prompt": "x", "max_tokens": 4, "guided_regex": "[a-c]{7}"}
    httpx.post(live.v1 + "/completions", json={**body, "guided_regex": "b"}, timeout=60)
    monkeypatch.setattr(grammars._compiler, "timeout_s", 0.2)  # built by the request above
    response = httpx.post(live.v1 + "/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "guided_regex" and "longer than 0.2 s" in error["message"]


def test_a_client_gone_while_its_grammar_compiles_starts_nothing(live, slow_compiles):
    manager = manager_of(live)
    grammars = manager.inputs.grammars
    # Built first (its vocabulary takes a while): a client gone while it builds asks for nothing.
    warm = {"prompt": "x", "max_tokens": 1, "guided_regex": "d"}
    assert httpx.post(live.v1 + "/completions", json=warm, timeout=60).status_code == 200
    compiler = grammars._compiler
    for stream in (False, True):
        client_id = f"gone-while-compiling-{stream}"
        regex = f"[d-f]{{{5 + stream}}}"
        body = {"prompt": "x", "max_tokens": 4, "guided_regex": regex, "stream": stream}
        asked, ran, cached = compiler.stats.misses, compiler.stats.compiles, len(compiler._cache)
        with pytest.raises(httpx.ReadTimeout):  # the client leaves after 0.3 s
            httpx.post(
                live.v1 + "/completions",
                json=body,
                headers={"X-Request-Id": client_id},
                timeout=httpx.Timeout(5.0, read=0.3),
            )
        # The compile was asked for, then either ran (it is not dropped once running, so it ends
        # in the cache) or, still queued when the client left (a loaded machine), was dropped.
        wait_until(
            lambda asked=asked: compiler.stats.misses > asked and not compiler._inflight,
            timeout=30,
            what="the compile to be asked for and then settle",
        )
        if compiler.stats.compiles > ran:
            assert len(compiler._cache) > cached
        assert httpx.get(live.url + "/health", timeout=10).status_code == 200
        assert manager.lifecycle.by_client_id(client_id) == []
        assert not compiler._inflight
    assert manager.num_requests_in_flight == 0


class Step(pydantic.BaseModel):
    # Bounded, so the grammar closes the object: unbounded, the 135M model's greedy explanation
    # repeats one sentence until max_tokens.
    explanation: str = pydantic.Field(max_length=40)
    output: str = pydantic.Field(max_length=20)


class Answer(pydantic.BaseModel):
    city: str
    country: Literal["France", "Germany", "Italy"]
    steps: list[Step] = pydantic.Field(max_length=2)


def test_the_openai_client_parses_into_a_pydantic_model(live):
    client = openai.OpenAI(base_url=live.v1, api_key="none")
    messages = [
        {"role": "system", "content": "Answer in JSON."},
        {"role": "user", "content": "What is the capital of France? Explain briefly."},
    ]
    completion = client.chat.completions.parse(
        model=MODEL, messages=messages, response_format=Answer, temperature=0, max_tokens=256
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Answer) and message.parsed.country in (
        "France",
        "Germany",
        "Italy",
    )
    schema = {"type": "object", "properties": {"capital": {"type": "string"}}}
    plain = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=64,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
    )
    assert isinstance(json.loads(plain.choices[0].message.content), dict)


def test_metrics_count_compiles_cache_hits_and_mask_time(live):
    body = {"prompt": "x", "max_tokens": 4, "temperature": 0, "guided_regex": "[g-i]{3}"}
    for _ in range(2):  # a miss, then a hit
        assert httpx.post(live.v1 + "/completions", json=body, timeout=60).status_code == 200
    text = httpx.get(live.url + "/metrics").text
    values = {}
    for line in text.splitlines():
        if line.startswith("yaied:structured_output"):
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0]] = values.get(name.split("{")[0], 0) + float(value)
    assert values["yaied:structured_output_compile_seconds_count"] >= 1
    assert values["yaied:structured_output_compile_cache_hits_total"] >= 1
    assert values["yaied:structured_output_compile_cache_misses_total"] >= 1
    assert values["yaied:structured_output_mask_seconds_total"] > 0
    assert values["yaied:structured_output_masked_steps_total"] >= 2


def test_compiles_run_off_the_event_loop(live, slow_compiles):
    """While a grammar compiles for one client, another request is answered at once."""
    slow = threading.Thread(
        target=httpx.post,
        args=(live.v1 + "/completions",),
        kwargs={
            "json": {"prompt": "x", "max_tokens": 2, "guided_regex": "[j-l]{4}"},
            "timeout": 60,
        },
    )
    grammars = manager_of(live).inputs.grammars
    slow.start()
    wait_until(  # the compiler is built by the first constrained request
        lambda: grammars._compiler is not None and grammars._compiler._inflight,
        timeout=30,
        what="the slow compile to start",
    )
    start = time.monotonic()
    assert httpx.get(live.url + "/health").status_code == 200
    assert time.monotonic() - start < 0.5
    slow.join()
