"""Speculative decoding through the HTTP server: events that carry several tokens become the
same text, logprobs and usage, streamed or not, as without speculation (greedy, fp32)."""

from __future__ import annotations

import json

import pytest

from tests.server.conftest import engine_loader, in_process_server
from yaied.server.config import ServerConfig

# A prompt that repeats itself, so that prompt lookup finds drafts and random weights, which
# fall into loops, accept some of them.
PROMPT = [5, 6, 7, 8, 9, 10] * 6


def run(client, stream: bool) -> tuple[list[int], str, list, dict]:
    body = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": 40,
        "temperature": 0,
        "logprobs": 2,
        "return_token_ids": True,
        "stream": stream,
    }
    if not stream:
        out = client.post("/v1/completions", json=body).json()
        choice = out["choices"][0]
        return choice["token_ids"], choice["text"], choice["logprobs"]["tokens"], out["usage"]
    body["stream_options"] = {"include_usage": True}
    ids, text, tokens, usage = [], "", [], {}
    with client.stream("POST", "/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                ids += choice["token_ids"]
                text += choice["text"]
                tokens += (choice["logprobs"] or {}).get("tokens", [])
    return ids, text, tokens, usage


@pytest.fixture(scope="module")
def servers(tiny_model_dirs):
    common = dict(model=str(tiny_model_dirs["llama"]), max_model_len=0, threads=1, dtype="float32")
    config = ServerConfig(served_model_name="tiny")
    with (
        in_process_server(config, engine_loader(**common), "tiny") as off,
        in_process_server(
            config,
            engine_loader(**common, speculative_method="ngram", num_speculative_tokens=4),
            "tiny",
        ) as on,
    ):
        yield off, on


@pytest.mark.parametrize("stream", [False, True])
def test_speculation_changes_nothing_a_client_sees(servers, stream):
    off, on = servers
    expected = run(off, stream)
    got = run(on, stream)
    assert len(expected[0]) == 40
    assert got[:3] == expected[:3]  # token ids, text, logprob tokens
    for usage in (got[3], expected[3]):  # cached_tokens depends on what each server ran before
        usage.pop("prompt_tokens_details")
    assert got[3] == expected[3]
    metrics = on.get("/metrics").text
    drafted = [
        line for line in metrics.splitlines() if line.startswith("yaied:spec_decode_num_drafts")
    ]
    assert drafted and float(drafted[0].split()[-1]) > 0
