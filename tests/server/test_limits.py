"""Auth and queue limits, on a tiny random-weight model (token-id prompts, no tokenizer)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server.conftest import engine_loader, start_server, stop_server
from yaied.server.config import ServerConfig

KEY = {"Authorization": "Bearer secret"}


@pytest.fixture(scope="module")
def tiny(tiny_model_dirs):
    config = ServerConfig(api_keys=("secret",), max_queue_len=1, served_model_name="tiny")
    loader = engine_loader(
        model=str(tiny_model_dirs["llama"]), max_num_seqs=1, max_model_len=0, threads=1
    )
    server = start_server(config, loader, "ignored")
    yield server
    stop_server(server)


def test_api_keys(tiny):
    body = {"prompt": [1, 2], "max_tokens": 2, "model": "tiny"}
    assert httpx.post(tiny.v1 + "/completions", json=body).status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    r = httpx.post(tiny.v1 + "/completions", json=body, headers=wrong)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(tiny.v1 + "/completions", json=body, headers=KEY)
    assert r.status_code == 200 and r.json()["model"] == "tiny"
    assert r.json()["choices"][0]["text"] == ""  # no tokenizer: tokens only
    assert httpx.get(tiny.url + "/health").status_code == 200  # probes need no key
    r = httpx.post(
        tiny.v1 + "/chat/completions", json={"messages": [{"role": "user"}]}, headers=KEY
    )
    assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]


def test_queue_full_is_429_with_retry_after(tiny):
    long = {"prompt": [1, 2, 3], "max_tokens": 1000, "ignore_eos": True}
    url = tiny.v1 + "/completions"
    # max_num_seqs=1: the first runs, the second waits (the queue holds 1), the third is refused.
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(httpx.post, url, json=long, headers=KEY, timeout=60)
        time.sleep(0.1)
        waiting = pool.submit(httpx.post, url, json=long, headers=KEY, timeout=60)
        time.sleep(0.3)
        r = httpx.post(url, json={"prompt": [1], "max_tokens": 1}, headers=KEY)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "rate_limit_error"
        assert running.result().status_code == waiting.result().status_code == 200
