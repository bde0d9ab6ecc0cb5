"""The soak's requests (scripts/soak.py): what each one asks, how it behaves, and what came back.

Every request ends as one Outcome:

- ``ok``: a complete answer (non-streaming: every choice with a finish_reason; streaming: every
  choice finished, no error chunk, then ``data: [DONE]``);
- ``client_error`` / ``server_error``: a 4xx / 5xx with an OpenAI error body (a 429 must carry
  Retry-After), or a streamed error chunk (a server error);
- ``disconnected`` / ``cancelled``: the client left on purpose, mid-stream or mid-wait;
- ``api_cancelled``: the client cancelled its own stream through ``POST /v1/requests/{id}/cancel``
  (by the X-Request-Id it sent) and the stream still ended properly: a finish_reason on every
  choice (``abort``, or the real one if the answer finished first), then ``data: [DONE]``;
- ``hung``: nothing final within the request timeout; ``broken``: anything else.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx

MODEL_NAME = "soak"
_WORD_TEXT = (
    "the quick brown fox jumps over a lazy dog while seven bright stars shine on cold water "
    "naïve café déjà vu Größe 東京 数据 🙂 🚀 ÷ ∑ λ — «quoted» 'single' \"double\" \\ / <tag> "
    "\t tab new\nline 0 1 2 3 42 3.14 -7 1e9"
)
WORDS = _WORD_TEXT.split(" ")  # plain, accented, CJK, emoji, quotes, escapes, whitespace
SYSTEM = "You are a careful assistant. " * 12  # a shared prefix: prefix-cache hits


@dataclass(slots=True)
class RequestSpec:
    path: str
    body: dict[str, Any]
    stream: bool
    disconnect_after: int | None = None  # leave after this many data lines
    cancel_after: float | None = None  # give up waiting after this many seconds
    retries: int = 0  # on 429, wait Retry-After and try again this many times
    api_cancel_after: int | None = None  # cancel through the API after this many data lines
    headers: dict[str, str] | None = None


@dataclass(slots=True)
class Outcome:
    kind: str
    detail: str = ""
    stream: bool = False
    output_tokens: int = 0
    retry_after: float = 0.0  # a 429's Retry-After
    retries: int = 0  # 429s retried before this outcome
    latency: float = 0.0  # seconds from the first attempt to the outcome


def _text(rng: random.Random) -> str:
    size = rng.choice([rng.randint(1, 20), rng.randint(20, 200), rng.randint(200, 700)])
    words = " ".join(rng.choice(WORDS) for _ in range(size))
    return (SYSTEM + words) if rng.random() < 0.3 else words


def _sampling(rng: random.Random, chat: bool) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if rng.random() < 0.3:
        body["temperature"] = 0
    else:
        body["temperature"] = round(rng.uniform(0.1, 1.5), 2)
        if rng.random() < 0.4:
            body["top_p"] = round(rng.uniform(0.1, 1.0), 2)
        if rng.random() < 0.3:
            body["top_k"] = rng.choice([1, 5, 50])
        if rng.random() < 0.3:
            body["seed"] = rng.randint(0, 2**31)
    if rng.random() < 0.2:
        body["presence_penalty"] = round(rng.uniform(-1, 1), 2)
        body["frequency_penalty"] = round(rng.uniform(-1, 1), 2)
    if rng.random() < 0.2:
        body["stop"] = rng.sample(WORDS, 2)
    if rng.random() < 0.2:
        body |= {"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2}
    if rng.random() < 0.3:
        body["ignore_eos"] = True
    if rng.random() < 0.1:
        body["n"] = 2
    if rng.random() < 0.9:  # otherwise the default: 16, or chat's rest of context (capped)
        key = "max_completion_tokens" if chat and rng.random() < 0.5 else "max_tokens"
        body[key] = rng.randint(1, 48)
    return body


def _invalid(rng: random.Random) -> dict[str, Any]:
    return rng.choice(
        [
            {"temperature": -1},
            {"n": 0},
            {"max_tokens": 10_000},
            {"top_p": 0},
            {"logit_bias": {"999999": 1}},
            {"model": "not-this-one"},
        ]
    )


def make_spec(rng: random.Random, index: int, *, burst: bool = False) -> RequestSpec:
    chat = rng.random() < 0.5
    body: dict[str, Any] = {"model": MODEL_NAME, **_sampling(rng, chat)}
    if chat:
        messages = [{"role": "user", "content": _text(rng)}]
        if rng.random() < 0.3:
            messages = [{"role": "system", "content": SYSTEM}, *messages]
        body["messages"] = messages
    else:
        body["prompt"] = _text(rng)
    if burst:
        body |= {"max_tokens": 4, "n": 1}
        body.pop("max_completion_tokens", None)
    elif rng.random() < 0.03:
        body |= _invalid(rng)
    stream = not burst and rng.random() < 0.5
    path = "/v1/chat/completions" if chat else "/v1/completions"
    spec = RequestSpec(path, body, stream, retries=0 if burst else 3)
    if stream:
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        if rng.random() < 0.2:  # 20% of streaming clients leave mid-stream
            spec.disconnect_after = rng.randint(1, 6)
        elif rng.random() < 0.1:  # and some cancel through the API, staying for the end
            spec.api_cancel_after = rng.randint(1, 4)
            spec.headers = {"X-Request-Id": f"soak-{index}-{rng.getrandbits(32):08x}"}
    elif not burst and rng.random() < 0.1:
        spec.cancel_after = rng.uniform(0.01, 0.5)
    return spec


async def run_request(client: httpx.AsyncClient, spec: RequestSpec, timeout: float) -> Outcome:
    """Send the request (again after a 429, up to spec.retries times, as OpenAI clients do)."""
    start = time.monotonic()
    for attempt in range(spec.retries + 1):
        outcome = await _attempt(client, spec, timeout)
        if not outcome.retry_after or attempt == spec.retries:
            break
        await asyncio.sleep(outcome.retry_after)
    outcome.retries = attempt
    outcome.latency = time.monotonic() - start
    return outcome


async def _attempt(client: httpx.AsyncClient, spec: RequestSpec, timeout: float) -> Outcome:
    send = _stream(client, spec) if spec.stream else _plain(client, spec)
    try:
        if spec.cancel_after is not None:
            try:
                return await asyncio.wait_for(send, spec.cancel_after)
            except TimeoutError:
                return Outcome("cancelled")
        return await asyncio.wait_for(send, timeout)
    except TimeoutError:
        return Outcome("hung", f"{spec.path} no answer in {timeout} s", spec.stream)
    except httpx.TimeoutException as exc:
        return Outcome("hung", f"{spec.path}: {type(exc).__name__}", spec.stream)
    except httpx.TransportError as exc:
        return Outcome("broken", f"{spec.path}: {type(exc).__name__}: {exc}", spec.stream)


def _error(response: httpx.Response, body: bytes, stream: bool) -> Outcome:
    try:
        error = json.loads(body)["error"]
        assert isinstance(error["message"], str) and error["message"]
    except (ValueError, KeyError, TypeError, AssertionError):
        return Outcome("broken", f"{response.status_code} without an OpenAI error body", stream)
    retry_after = 0.0
    if response.status_code == 429:
        if not response.headers.get("retry-after", "").isdigit():
            return Outcome("broken", "429 without a Retry-After in seconds", stream)
        retry_after = float(response.headers["retry-after"])
    kind = "server_error" if response.status_code >= 500 else "client_error"
    detail = f"{response.status_code} {error.get('code')}"
    return Outcome(kind, detail, stream, retry_after=retry_after)


async def _plain(client: httpx.AsyncClient, spec: RequestSpec) -> Outcome:
    response = await client.post(spec.path, json=spec.body, headers=spec.headers)
    if response.status_code != 200:
        return _error(response, response.content, False)
    body = response.json()
    n = spec.body.get("n", 1)
    choices = body.get("choices", [])
    if len(choices) != n or any(c.get("finish_reason") not in ("stop", "length") for c in choices):
        return Outcome("broken", f"incomplete answer: {json.dumps(body)[:200]}")
    return Outcome("ok", output_tokens=body["usage"]["completion_tokens"])


async def _stream(client: httpx.AsyncClient, spec: RequestSpec) -> Outcome:
    async with client.stream("POST", spec.path, json=spec.body, headers=spec.headers) as response:
        if response.status_code != 200:
            return _error(response, await response.aread(), True)
        finished: set[int] = set()
        cancel_sent = False
        lines = 0
        tokens = 0
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue  # blank separators and ": ping" comments
            lines += 1
            if spec.disconnect_after is not None and lines >= spec.disconnect_after:
                return Outcome("disconnected", stream=True)  # closing the response leaves
            due = spec.api_cancel_after is not None and lines >= spec.api_cancel_after
            if due and not cancel_sent:
                cancel_sent = True
                problem = await _cancel(client, spec)
                if problem:
                    return Outcome("broken", problem, True)
            if line == "data: [DONE]":
                n = spec.body.get("n", 1)
                if len(finished) != n:
                    return Outcome("broken", f"[DONE] after {len(finished)}/{n} choices", True)
                kind = "api_cancelled" if cancel_sent else "ok"
                return Outcome(kind, stream=True, output_tokens=tokens)
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return Outcome("server_error", f"stream {chunk['error'].get('code')}", True)
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk["choices"]:
                if choice.get("finish_reason") is not None:
                    finished.add(choice["index"])
                    if choice["finish_reason"] == "abort" and not cancel_sent:
                        return Outcome("broken", "abort without a cancel", True)
    return Outcome("broken", "the stream ended without [DONE]", True)


async def _cancel(client: httpx.AsyncClient, spec: RequestSpec) -> str:
    """Cancel the spec's stream by its X-Request-Id; a problem's description, or ""."""
    request_id = (spec.headers or {})["X-Request-Id"]
    response = await client.post(f"/v1/requests/{request_id}/cancel")
    # 404: the request had finished already (its last chunks are still on their way).
    if response.status_code not in (200, 404):
        return f"cancel answered {response.status_code}"
    return ""
