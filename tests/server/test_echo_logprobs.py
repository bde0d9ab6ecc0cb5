"""Echo + logprobs through HTTP, as lm-evaluation-harness sends them for log-likelihoods.

Prompts of one token, exactly one KV page, one page and a token, and several pages, alone and
beside requests that share their prefix: each gets its prompt scored, the scores do not depend on
what else ran, and the engine stays up with every page back.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server.conftest import engine_loader, start_server, stop_server
from tests.server.test_faults import wait_idle
from yaied.server.config import ServerConfig

PAGE = 16  # the default page size
LENGTHS = [1, PAGE, PAGE + 1, 3 * PAGE + 5]


@pytest.fixture(scope="module")
def tiny(tiny_model_dirs):
    loader = engine_loader(
        model=str(tiny_model_dirs["llama"]), max_model_len=0, threads=1, dtype="float32"
    )
    server = start_server(ServerConfig(served_model_name="tiny"), loader, "ignored")
    yield server
    stop_server(server)


def score(url: str, prompt: list[int]) -> list[float | None]:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 1,
        "echo": True,
        "logprobs": 1,
        "temperature": 0,
    }
    response = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    logprobs = response.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert len(logprobs) == len(prompt) + 1  # every prompt token, then the sampled one
    return logprobs


def prompt_of(length: int, salt: int = 0) -> list[int]:
    return [(7 * i + 3 + salt) % 250 + 1 for i in range(length)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("length", LENGTHS)
def test_echo_logprobs_alone(tiny, length):
    prompt = prompt_of(length)
    first = score(tiny.url, prompt)
    assert first[0] is None and all(v <= 0 for v in first[1:])
    # Again, now that its pages are cached: the same scores (it must not skip cached positions).
    assert score(tiny.url, prompt) == pytest.approx(first, abs=1e-5, nan_ok=False)
    assert httpx.get(tiny.url + "/health").status_code == 200
    wait_idle(tiny.url)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("length", LENGTHS)
def test_echo_logprobs_beside_requests_sharing_the_prefix(tiny, length):
    prompt = prompt_of(length, salt=1)
    alone = score(tiny.url, prompt)
    # Longer prompts with the same prefix, scored and plain, all at once.
    longer = [prompt + prompt_of(n, salt=2) for n in (1, PAGE, 2 * PAGE)]
    plain = {"model": "tiny", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(8) as pool:
        scored = [pool.submit(score, tiny.url, p) for p in [prompt, *longer, prompt]]
        generated = [
            pool.submit(
                httpx.post, tiny.url + "/v1/completions", json={**plain, "prompt": p}, timeout=60
            )
            for p in [prompt, *longer]
        ]
        scored_results = [f.result() for f in scored]
        assert all(f.result().status_code == 200 for f in generated)
    for result in (scored_results[0], scored_results[-1]):
        assert result == pytest.approx(alone, abs=1e-4)
    for result in scored_results[1:-1]:  # the shared part scores the same as alone
        assert result[: len(prompt)] == pytest.approx(alone[: len(prompt)], abs=1e-4)
    assert httpx.get(tiny.url + "/health").status_code == 200
    wait_idle(tiny.url)


@pytest.mark.timeout(120)
def test_scoring_a_prompt_that_fills_the_context_names_what_the_client_sent(tiny):
    """max_tokens 0 runs one token past the prompt: at the context's end the 400 says so, and
    does not blame a max_tokens of 1 the client never sent."""
    limit = httpx.get(tiny.url + "/v1/models").json()["data"][0]["max_model_len"]
    body = {"model": "tiny", "max_tokens": 0, "echo": True, "logprobs": 1}
    full = httpx.post(tiny.url + "/v1/completions", json={**body, "prompt": prompt_of(limit)})
    assert full.status_code == 400, full.text
    message = full.json()["error"]["message"]
    assert "max_tokens (1)" not in message
    assert f"{limit - 1} tokens" in message and "max_tokens 0" in message
    fits = httpx.post(tiny.url + "/v1/completions", json={**body, "prompt": prompt_of(limit - 1)})
    assert fits.status_code == 200, fits.text
    assert len(fits.json()["choices"][0]["logprobs"]["token_logprobs"]) == limit - 1
