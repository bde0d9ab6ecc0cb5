"""/v1/embeddings on the default model with the official openai client: normalised vectors,
float and base64 alike, a batch equal to its inputs one by one, token-id inputs, usage, and
the 400s."""

from __future__ import annotations

import base64
import math
import struct

import httpx
import openai
import pytest

from tests.server.conftest import MODEL

TEXTS = ["The cat sat on the mat.", "Paris is the capital of France.", "def f(x): return x"]


@pytest.fixture
def client(live):
    return openai.OpenAI(base_url=live.v1, api_key="none", max_retries=0)


def close(a: list[float], b: list[float], tol: float = 2e-3) -> bool:
    return max(abs(x - y) for x, y in zip(a, b, strict=True)) < tol


def test_a_batch_equals_its_inputs_one_by_one(client):
    batch = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert [item.index for item in batch.data] == [0, 1, 2]
    assert batch.usage.prompt_tokens == batch.usage.total_tokens > 10
    for text, item in zip(TEXTS, batch.data, strict=True):
        assert math.isclose(math.fsum(v * v for v in item.embedding), 1.0, rel_tol=1e-4)
        alone = client.embeddings.create(model=MODEL, input=text, encoding_format="float")
        assert close(alone.data[0].embedding, item.embedding)
    # different texts, different vectors
    assert not close(batch.data[0].embedding, batch.data[1].embedding, 0.05)


def test_base64_and_token_ids(live, client):
    url = live.v1 + "/embeddings"
    floats = httpx.post(url, json={"model": MODEL, "input": TEXTS[0]}).json()["data"][0]
    packed = httpx.post(url, json={"input": TEXTS[0], "encoding_format": "base64"}).json()
    raw = base64.b64decode(packed["data"][0]["embedding"])
    unpacked = list(struct.unpack(f"<{len(raw) // 4}f", raw))
    assert close(unpacked, floats["embedding"], 1e-6)
    ids = httpx.post(live.url + "/tokenize", json={"prompt": TEXTS[0]}).json()["tokens"]
    by_ids = httpx.post(url, json={"input": ids}).json()["data"][0]["embedding"]
    assert close(by_ids, floats["embedding"])
    last = httpx.post(url, json={"input": TEXTS[0], "pooling": "last"}).json()
    assert not close(last["data"][0]["embedding"], floats["embedding"], 0.05)
    sdk = client.embeddings.create(model=MODEL, input=TEXTS[0])  # the SDK asks for base64
    assert close(sdk.data[0].embedding, floats["embedding"], 1e-6)


def test_bad_requests_get_400(live):
    url = live.v1 + "/embeddings"
    for body, param in [
        ({"input": "x", "dimensions": 8}, "dimensions"),
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": "x", "nope": 1}, "nope"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "x", "pooling": "max"}, "pooling"),
        ({"input": [10**9]}, "input"),
    ]:
        response = httpx.post(url, json=body)
        assert response.status_code == 400, (body, response.text)
        assert response.json()["error"]["param"] == param, response.text


def test_an_input_may_fill_the_context_and_no_more(live):
    """An embedding decodes nothing: an input may hold the whole context (1024 tokens on the
    live server), and one token more is a 400 that speaks of the input, not of max_tokens."""
    url = live.v1 + "/embeddings"
    full = httpx.post(url, json={"input": [28] * 1024})
    assert full.status_code == 200, full.text
    assert full.json()["usage"]["prompt_tokens"] == 1024
    over = httpx.post(url, json={"input": [28] * 1025})
    assert over.status_code == 400, over.text
    error = over.json()["error"]
    assert error["param"] == "input", error
    assert error["message"].startswith("input (1025 tokens) exceeds"), error
    assert error["code"] == "context_length_exceeded", error
