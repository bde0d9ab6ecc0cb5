"""Fuzzing: generated junk against every route never gets a 5xx, and every error is an OpenAI error
body. Junk JSON bodies on the POST endpoints; any method, query string, headers and raw bytes on
every route; unicode, empty and enormous text prompts and chat messages through a real tokenizer
and chat template. (Schema-driven cases are in test_schemathesis.py.)

The junk goes to a tiny model's app in-process (no socket: the answers are what is tested); the
text prompts go to the default model's live server (slow, as every test on it: conftest.py)."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import engine_loader, in_process_server
from yaied.server.config import ServerConfig

ENDPOINTS = [
    "/v1/completions",
    "/v1/chat/completions",
    "/tokenize",
    "/detokenize",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/embeddings",
]
FIELDS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "stream",
    "stop",
    "seed",
    "logprobs",
    "top_logprobs",
    "echo",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "priority",
    "user",
    "stream_options",
    "tokens",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    # the agents' APIs (Responses, Messages) and embeddings
    "input",
    "instructions",
    "max_output_tokens",
    "previous_response_id",
    "store",
    "text",
    "reasoning",
    "system",
    "stop_sequences",
    "thinking",
    "output_config",
    "encoding_format",
    "dimensions",
    "pooling",
    "context_management",
    "max_tool_calls",
]
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True),
    st.text(max_size=20),
)
junk = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(
            st.sampled_from(
                ["role", "content", "type", "text", "1", "function", "name", "parameters"]
                + ["tool_calls", "tool_call_id", "arguments", "input_schema", "input"]
                + ["tool_use_id", "call_id", "output", "format", "schema"]
                + ["edits", "trigger", "keep", "value", "syntax", "definition", "source", "data"]
            ),
            inner,
            max_size=3,
        ),
    ),
    max_leaves=8,
)
bodies = st.dictionaries(st.sampled_from(FIELDS), junk, max_size=6)


@pytest.fixture(scope="module")
def tiny(tiny_model_dirs):
    loader = engine_loader(model=str(tiny_model_dirs["llama"]), max_model_len=0, threads=1)
    with in_process_server(ServerConfig(served_model_name="tiny"), loader, "ignored") as client:
        yield client


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(endpoint=st.sampled_from(ENDPOINTS), body=bodies)
def test_junk_bodies_never_get_a_5xx(tiny, endpoint, body):
    for name in ("max_tokens", "max_output_tokens"):
        if isinstance(body.get(name), int):
            body[name] = min(body[name], 8)  # keep valid requests short
    body.pop("stream", None)  # streaming junk is covered by the live tests
    content = json.dumps(body)  # stdlib: huge integers and NaN go out as written
    response = tiny.post(endpoint, content=content, headers={"Content-Type": "application/json"})
    assert response.status_code < 500, (endpoint, body, response.text)
    assert_error_body(response, endpoint)


def assert_error_body(response: httpx.Response, path: str) -> None:
    """OpenAI's error shape, or Anthropic's under /v1/messages."""
    if response.status_code < 400:
        return
    body = response.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and body["error"]["type"].endswith("_error")
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]
        return
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert {"type", "param", "code"} <= set(error)


def test_engine_still_serves_after_fuzzing(tiny):
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0}
    response = tiny.post("/v1/completions", json=body)
    assert response.status_code == 200


# -- every route, any method, junk query strings, headers and raw bodies ---------------------

ROUTES = [
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/tokenize",
    "/detokenize",
    "/health",
    "/metrics",
    "/openapi.json",
    "/v1",
    "/v1/models/tiny",
    "/%00",
    "/v1/responses",
    "/v1/responses/resp_0",
    "/v1/responses/resp_0/input_items",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/embeddings",
]
header_text = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=200).map(
    str.strip
)
headers = st.fixed_dictionaries(
    {},
    optional={
        "X-Request-Id": header_text,
        "X-Session-Id": header_text,
        "Authorization": header_text,
        "Content-Type": st.sampled_from(["application/json", "text/plain", "", "x/y; q=1"]),
        "Accept": header_text,
    },
)
raw_bodies = st.one_of(
    st.binary(max_size=200),
    bodies.map(lambda b: json.dumps(b).encode()),
    st.text(max_size=100).map(lambda t: t.encode("utf-8", "surrogatepass")),
)


def assert_openai_error(response: httpx.Response, method: str) -> None:
    assert response.status_code < 500, (method, response.request.url, response.text)
    if method != "HEAD":
        assert_error_body(response, response.request.url.path)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]),
    route=st.sampled_from(ROUTES),
    params=st.dictionaries(st.text(max_size=10), st.text(max_size=30), max_size=3),
    headers=headers,
    body=raw_bodies,
)
def test_any_route_method_query_and_headers_never_get_a_5xx(
    tiny, method, route, params, headers, body
):
    content = body if method in ("POST", "PUT", "PATCH") else None
    if content is not None and b'"max_tokens"' in content:
        return  # the bodies' own fuzz (above) keeps max_tokens short; skip long generations
    response = tiny.request(method, route, params=params, headers=headers, content=content)
    assert_openai_error(response, method)


# -- text prompts and chat messages, through a real tokenizer and chat template ---------------

prompts = st.one_of(
    st.text(max_size=300),  # any unicode, lone surrogates included
    st.just(""),
    st.just("tokens " * 100_000),  # far past the context, well within the body limit
    st.lists(st.text(max_size=20), max_size=3),
    st.lists(st.integers(-5, 60_000), max_size=20),
)
messages = st.one_of(
    junk,
    st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "assistant", "system", "tool", "x", ""])},
            optional={"content": st.one_of(st.text(max_size=200), junk)},
        ),
        max_size=4,
    ),
    st.just([{"role": "user", "content": "word " * 50_000}]),
)


@pytest.mark.timeout(240)
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    endpoint=st.sampled_from(ENDPOINTS),
    prompt=prompts,
    messages=messages,
    extra=st.dictionaries(st.sampled_from(["n", "stop", "logprobs", "echo", "seed"]), junk),
)
def test_text_prompts_and_messages_never_get_a_5xx(live, endpoint, prompt, messages, extra):
    body = {**extra, "prompt": prompt, "messages": messages, "max_tokens": 3}
    if endpoint in ("/v1/responses", "/v1/embeddings"):  # their text goes in input
        body = {**extra, "input": prompt if endpoint.endswith("embeddings") else messages}
        if endpoint == "/v1/responses":
            body["max_output_tokens"] = 3
    if isinstance(body.get("n"), int):
        body["n"] = min(body["n"], 2)  # valid requests stay short
    content = json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")
    response = httpx.post(
        live.url + endpoint,
        content=content,
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    assert response.status_code < 500, (endpoint, response.text)
    assert_error_body(response, endpoint)


REGEX_TEXT = st.text(alphabet='ab"\\\n.[]^-()|*+?{},09$\\dws', max_size=10)


@pytest.fixture(scope="module")
def tiny_chat(tiny_chat_model):
    loader = engine_loader(model=str(tiny_chat_model), max_model_len=2048, threads=1)
    with in_process_server(ServerConfig(served_model_name="tiny"), loader, "ignored") as client:
        yield client


@pytest.mark.slow
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(definition=REGEX_TEXT, fmt=st.sampled_from(["regex", "lark", None]))
def test_custom_tool_grammars_never_get_a_5xx(tiny_chat, definition, fmt):
    """Any pattern a client sends as a custom tool's regex, forced: the call runs (200) or the
    pattern is refused (400), compiled by xgrammar on the way; never a 5xx."""
    tool = {"type": "custom", "name": "t"}
    if fmt is not None:
        tool["format"] = {"type": "grammar", "syntax": fmt, "definition": definition}
    body = {"model": "tiny", "input": "x", "tools": [tool], "max_output_tokens": 4,
            "tool_choice": {"type": "custom", "name": "t"}}  # fmt: skip
    response = tiny_chat.post("/v1/responses", json=body)
    assert response.status_code in (200, 400), (definition, response.text)
    assert_error_body(response, "/v1/responses")
