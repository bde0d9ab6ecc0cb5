"""Auth and queue limits, on a tiny random-weight model (token-id prompts, no tokenizer)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server.conftest import engine_loader, start_server, stop_server
from yaied.kernels.cpu_isa import selected_level
from yaied.server.config import ServerConfig
from yaied.server.errors import APIError

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
    health = httpx.get(tiny.url + "/health")  # probes need no key
    assert health.status_code == 200
    # which code runs: the CPU kernels' ISA level (yaied/kernels/cpu_isa.py) and the dtypes
    assert health.json()["status"] == "ok" and health.json()["device"] == "cpu"
    assert health.json()["cpu_isa"] == selected_level() and health.json()["weight_dtype"]
    r = httpx.post(
        tiny.v1 + "/chat/completions", json={"messages": [{"role": "user"}]}, headers=KEY
    )
    assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]


def engine_gauge(server, name: str) -> float:
    """yaied:<name> from /metrics (one engine)."""
    text = httpx.get(server.url + "/metrics", headers=KEY).text
    line = next(line for line in text.splitlines() if line.startswith(f"yaied:{name}{{"))
    return float(line.rsplit(" ", 1)[1])


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def test_queue_full_is_429_with_retry_after(tiny):
    long = {"prompt": [1, 2, 3], "max_tokens": 1000, "ignore_eos": True}
    url = tiny.v1 + "/completions"
    # max_num_seqs=1: the first runs, the second waits (the queue holds 1), the third is refused.
    # Each step is waited for on the engine's gauges, not slept on: a thousand tokens of the tiny
    # model take a few tenths of a second, and the refusals come within milliseconds.
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(httpx.post, url, json=long, headers=KEY, timeout=60)
        wait_for(lambda: engine_gauge(tiny, "num_requests_running") == 1)
        waiting = pool.submit(httpx.post, url, json=long, headers=KEY, timeout=60)
        wait_for(lambda: engine_gauge(tiny, "num_requests_waiting") == 1)
        r = httpx.post(url, json={"prompt": [1], "max_tokens": 1}, headers=KEY)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "rate_limit_error"
        # Streaming too: a status before any byte of the stream, not a 200 and an error chunk.
        stream = {"prompt": [1], "max_tokens": 1, "stream": True}
        r = httpx.post(url, json=stream, headers=KEY)
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
        assert running.result().status_code == waiting.result().status_code == 200


ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def limited(tiny_model_dirs):
    config = ServerConfig(
        served_model_name="tiny",
        max_body_bytes=2048,
        max_prompt_tokens=8,
        max_tokens_limit=10,
        max_n=2,
        cors_allow_origins=(ORIGIN,),
    )
    loader = engine_loader(model=str(tiny_model_dirs["llama"]), max_model_len=0, threads=1)
    server = start_server(config, loader, "ignored")
    yield server
    stop_server(server)


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        ({"prompt": list(range(9))}, 400, "prompt", "prompt_too_long"),
        ({"prompt": [[1], list(range(9))]}, 400, "prompt", "prompt_too_long"),
        ({"prompt": [1], "max_tokens": 11}, 400, "max_tokens", "max_tokens_too_large"),
        ({"prompt": [1], "n": 3}, 400, "n", "n_too_large"),
        ({"prompt": [1] * 2000}, 413, None, "body_too_large"),
    ],
)
def test_configured_limits_are_clear_openai_errors(limited, body, status, param, code):
    r = httpx.post(limited.v1 + "/completions", json={"model": "tiny", **body})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == (param, code) and error["message"]


def test_requests_within_the_limits_run(limited):
    body = {"model": "tiny", "prompt": list(range(8)), "max_tokens": 10, "n": 2}
    r = httpx.post(limited.v1 + "/completions", json={**body, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 20
    r = httpx.post(limited.v1 + "/completions", json={"prompt": [1], "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 10  # 16, capped


def test_cors_only_for_configured_origins(limited, tiny):
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
    r = httpx.options(limited.v1 + "/completions", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.get(limited.url + "/health", headers={"Origin": ORIGIN})
    assert r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.get(limited.url + "/health", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in r.headers
    # Not configured (the default): no CORS headers, and a preflight is refused.
    r = httpx.get(tiny.url + "/health", headers={"Origin": ORIGIN})
    assert "access-control-allow-origin" not in r.headers
    r = httpx.options(tiny.v1 + "/completions", headers=preflight)
    assert r.status_code >= 400 and "access-control-allow-origin" not in r.headers


def test_secure_defaults():
    from yaied.core.config import ModelConfig

    config = ServerConfig()
    assert config.host == "127.0.0.1" and config.cors_allow_origins == ()
    assert config.max_body_bytes > 0 and config.max_queue_len > 0 and config.max_n == 128
    assert ModelConfig().trust_remote_code is False


def test_limits_reject_bad_settings():
    with pytest.raises(ValueError, match="server.max_prompt_tokens must be >= 0"):
        ServerConfig(max_prompt_tokens=-1)
    with pytest.raises(ValueError, match="server.max_n must be >= 1"):
        ServerConfig(max_n=0)
    with pytest.raises(ValueError, match="cors_allow_origins"):
        ServerConfig(cors_allow_origins=("",))


def test_chat_default_max_tokens_is_capped():
    from yaied.server.chat_protocol import parse_chat
    from yaied.server.limits import RequestLimits
    from yaied.server.protocol import parse_completion

    limits = RequestLimits(max_tokens=10)
    assert limits.default_max_tokens(500) == 10 and limits.default_max_tokens(4) == 4
    assert RequestLimits().default_max_tokens(500) == 500
    body = {"messages": [{"role": "user"}], "max_tokens": 5, "max_completion_tokens": 11}
    with pytest.raises(APIError) as caught:
        limits.check_parsed(parse_chat(body), body)
    assert caught.value.param == "max_completion_tokens"
    completion = parse_completion({"prompt": "x"})  # the default of 16 is capped, not refused
    limits.check_parsed(completion, {"prompt": "x"})
    assert completion.max_tokens == 10
