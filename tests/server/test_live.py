"""The real app under uvicorn with the default model: clients, SSE framing, errors, metrics."""

from __future__ import annotations

import time

import httpx
import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import MODEL
from yaied.core.metric_names import (
    CALL_MIGRATIONS,
    INFERENCE_EXTENSION_NAMES,
    LORA_REQUESTS_INFO,
)

DESIGN_METRICS = [
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",
    "prefix_cache_queries_total",
    "prefix_cache_hits_total",
    "prompt_tokens_total",
    "generation_tokens_total",
    "request_success_total",
    "num_preemptions_total",
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "iteration_tokens_total",
]
CHAT = [{"role": "user", "content": "Say hi."}]
# Whole-pod families, without an engine label: the pool's own (engines by state, calls moved
# between engines) and the
# Inference Extension's names, one series for the pod.
POOL_FAMILIES = {
    "yaied:engines",
    "yaied:autoscale_events",
    f"yaied:{CALL_MIGRATIONS}",
    LORA_REQUESTS_INFO,
    *(name for names in INFERENCE_EXTENSION_NAMES.values() for name in names),
}


def scrape(url: str) -> dict[str, float]:
    """Unlabelled-by-reason sample values by name, plus every family and sample name (as keys)."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        values.setdefault(family.name, 0.0)
        for sample in family.samples:
            if family.name.startswith("process_"):  # the daemon's process, as any service's
                assert not sample.labels
                continue
            # Every sample but the whole pod's is one engine's.
            if family.name not in POOL_FAMILIES:
                assert sample.labels.get("engine") == "0"
            # vLLM's LoRA gauge names adapters, not the model; the endpoint picker reads it so.
            if family.name != LORA_REQUESTS_INFO:
                assert sample.labels.get("model_name") == MODEL
            values[sample.name] = sample.value
    return values


def test_openai_sync_completion_and_stream(live):
    client = openai.OpenAI(base_url=live.v1, api_key="none")
    out = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=4, temperature=0)
    assert out.choices[0].finish_reason == "length" and out.choices[0].text
    assert out.usage.completion_tokens == 4 and out.usage.prompt_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + 4
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="1, 2, 3,", max_tokens=4, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == out.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_openai_async_chat_and_stream(live):
    client = openai.AsyncOpenAI(base_url=live.v1, api_key="none")
    out = await client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2
    )
    choice = out.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert len(choice.logprobs.content) == 5
    assert len(choice.logprobs.content[0].top_logprobs) == 2
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_completion_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        n=2,
    )
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    texts = {0: "", 1: ""}
    finished = set()
    for c in chunks[:-1]:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finished.add(ch.index)
    # Compared with a non-streamed answer over the same cached prompt: a prompt's first prefill
    # and one over its cached prefix round differently in bf16, which can flip a near-tie (this
    # prompt's first two tokens are 0.04 apart in fp32).
    again = await client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=5, temperature=0
    )
    assert finished == {0, 1} and texts[0] == texts[1] == again.choices[0].message.content


def test_raw_sse_framing_and_request_id(live):
    body = {"prompt": [1, 2, 3], "max_tokens": 3, "stream": True, "ignore_eos": True}
    headers = {"X-Request-Id": "my-req"}
    with httpx.stream("POST", live.v1 + "/completions", json=body, headers=headers) as r:
        assert r.status_code == 200 and r.headers["x-request-id"] == "my-req"
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e and not e.startswith(":")]
    assert raw.endswith("data: [DONE]\n\n") and events[-1] == "data: [DONE]"
    for event in events[:-1]:
        assert event.startswith("data: {") and "\n" not in event
        assert orjson.loads(event[6:])["id"] == "my-req"


def test_echo_with_zero_max_tokens_scores_the_prompt(live):
    body = {"prompt": ["Paris is", "Rome is"], "max_tokens": 0, "echo": True, "logprobs": 1}
    out = httpx.post(live.v1 + "/completions", json=body).json()
    assert [c["text"] for c in out["choices"]] == ["Paris is", "Rome is"]
    lp = out["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None and all(v < 0 for v in lp["token_logprobs"][1:])
    assert "".join(lp["tokens"]) == "Paris is" and lp["text_offset"][0] == 0
    assert out["usage"]["completion_tokens"] == 0


JSON = {"Content-Type": "application/json"}  # raw bodies must say so (else 415)
BAD_INPUTS = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 5000}, 400, "prompt"),
    ("/v1/completions", {"prompt": [10**9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"999999": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, 400, "best_of"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "tools": [{"type": "function"}]},
        400,
        "tools[0].function",
    ),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 0}, 400, "max_completion_tokens"),
    ("/v1/nope", {}, 404, None),
]


@pytest.mark.parametrize("path, body, status, param", BAD_INPUTS)
def test_bad_inputs(live, path, body, status, param):
    content = body if isinstance(body, bytes) else orjson.dumps(body)
    r = httpx.post(live.url + path, content=content, headers=JSON)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"] and error["param"] == param


def test_body_limit_models_tokenize_health_openapi(live):
    assert httpx.get(live.url + "/health").status_code == 200
    big = b"[" + b"1," * (5 * 2**20) + b"1]"
    r = httpx.post(live.v1 + "/completions", content=big, headers=JSON)
    assert r.status_code == 413
    assert httpx.get(live.v1 + "/models").json()["data"][0]["id"] == MODEL
    tok = httpx.post(live.url + "/tokenize", json={"prompt": "Hello world"}).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 1024
    text = httpx.post(live.url + "/detokenize", json={"tokens": tok["tokens"]}).json()
    assert text["prompt"] == "Hello world"
    chat = httpx.post(live.url + "/tokenize", json={"messages": CHAT}).json()
    assert chat["count"] > tok["count"]
    paths = httpx.get(live.url + "/openapi.json").json()["paths"]
    assert {"/v1/completions", "/v1/chat/completions", "/metrics"} <= set(paths)


def _wait_idle(url: str) -> dict[str, float]:
    for _ in range(100):
        values = scrape(url)
        if values["yaied:num_requests_running"] == 0 and values["yaied:kv_cache_usage_perc"] == 0:
            return values
        time.sleep(0.05)
    return values


def test_disconnects_abort_and_metrics_carry_every_name(live):
    body = {"prompt": [1, 2, 3], "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", live.v1 + "/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")  # generating: now leave mid-stream
    values = _wait_idle(live.url)
    assert values["yaied:num_requests_running"] == 0
    assert values["yaied:kv_cache_usage_perc"] == 0
    body["stream"] = False
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live.v1 + "/completions", json=body, timeout=0.5)
    values = _wait_idle(live.url)
    assert values["yaied:num_requests_running"] == 0
    assert values["yaied:kv_cache_usage_perc"] == 0
    for name in DESIGN_METRICS:
        assert f"yaied:{name}" in values or f"yaied:{name.removesuffix('_total')}" in values, name
    assert values["yaied:generation_tokens_total"] > 0
