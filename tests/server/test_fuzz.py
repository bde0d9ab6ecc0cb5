"""Fuzzing: generated junk bodies against every POST endpoint never get a 5xx, and every error is
an OpenAI error body. (A short run here; the soak and longer fuzzing belong to the reliability
suite.)"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import engine_loader, start_server, stop_server
from yaied.server.config import ServerConfig

ENDPOINTS = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]
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
            st.sampled_from(["role", "content", "type", "text", "1"]), inner, max_size=3
        ),
    ),
    max_leaves=8,
)
bodies = st.dictionaries(st.sampled_from(FIELDS), junk, max_size=6)


@pytest.fixture(scope="module")
def tiny(tiny_model_dirs):
    loader = engine_loader(model=str(tiny_model_dirs["llama"]), max_model_len=0, threads=1)
    server = start_server(ServerConfig(served_model_name="tiny"), loader, "ignored")
    yield server
    stop_server(server)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(endpoint=st.sampled_from(ENDPOINTS), body=bodies)
def test_junk_bodies_never_get_a_5xx(tiny, endpoint, body):
    if body.get("max_tokens") is not None and isinstance(body.get("max_tokens"), int):
        body["max_tokens"] = min(body["max_tokens"], 8)  # keep valid requests short
    body.pop("stream", None)  # streaming junk is covered by the live tests
    content = json.dumps(body)  # stdlib: huge integers and NaN go out as written
    response = httpx.post(
        tiny.url + endpoint,
        content=content,
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert response.status_code < 500, (endpoint, body, response.text)
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"]
        assert {"type", "param", "code"} <= set(error)


def test_engine_still_serves_after_fuzzing(tiny):
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0}
    response = httpx.post(tiny.v1 + "/completions", json=body, timeout=30)
    assert response.status_code == 200
