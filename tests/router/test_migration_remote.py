"""Migration between remote engines (two yaied daemons on loopback, tiny model, fp32): a call
moved to a daemon carries the tokens its caller has as ``resume_token_ids``, and the daemon
streams only what follows, as greedy decoding without the move would."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from tests.server.conftest import LiveServer, engine_loader, start_server, stop_server
from tests.waiting import async_wait_until
from yaied.core.config import load_config
from yaied.core.request import FinishReason, SamplingParams
from yaied.router.build import build_manager
from yaied.router.config import EngineEntry, RouterConfig
from yaied.server.config import ServerConfig

pytestmark = pytest.mark.timeout(120)
PROMPT = list(range(5, 25))


@pytest.fixture(scope="module")
def daemons(tiny_model_dirs) -> Iterator[list[LiveServer]]:
    loader = engine_loader(model=str(tiny_model_dirs["llama"]), threads=1, dtype="float32")
    live = [start_server(ServerConfig(), loader, "tiny") for _ in range(2)]
    yield live
    for server in live:
        stop_server(server)


def completion(url: str, **extra: object) -> httpx.Response:
    body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    body |= {"return_token_ids": True, **extra}
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def test_a_daemon_resumes_after_the_tokens_sent(daemons):
    reference = completion(daemons[0].url).json()["choices"][0]["token_ids"]
    rest = completion(daemons[1].url, resume_token_ids=reference[:15]).json()
    assert rest["choices"][0]["token_ids"] == reference[15:]
    assert rest["choices"][0]["finish_reason"] == "length"
    assert (rest["usage"]["prompt_tokens"], rest["usage"]["completion_tokens"]) == (20, 40)
    generated = 'yaied:generation_tokens_total{engine="0",model_name="tiny"} 25.0'
    assert generated in httpx.get(daemons[1].url + "/metrics").text  # not the 15 sent before
    for bad in ([-1], list(range(40)), "x"):
        assert completion(daemons[1].url, resume_token_ids=bad).status_code == 400
    assert completion(daemons[1].url, resume_token_ids=[1], n=2).status_code == 400


async def test_streams_move_from_a_removed_remote_engine_to_another(daemons, tiny_model_dirs):
    config = load_config(env={}, overrides={"model": str(tiny_model_dirs["llama"])})
    entries = tuple(EngineEntry(kind="remote", url=d.url) for d in daemons)
    manager = build_manager(config, RouterConfig(long_call_threshold=8), entries)
    await manager.start()
    try:
        params = SamplingParams(max_tokens=600, temperature=0, ignore_eos=True)
        first = await manager.submit_request(session_id="s", prompt=PROMPT, sampling_params=params)
        reference = (await first.result()).token_ids
        handles = [
            await manager.submit_request(session_id="s", prompt=PROMPT, sampling_params=params)
            for _ in range(4)
        ]
        source = first.engine_id
        assert {h.engine_id for h in handles} == {source}
        outputs = [asyncio.create_task(h.result()) for h in handles]
        await async_wait_until(
            lambda: all(c.num_output_tokens >= 5 for c in manager._calls.values()),
            timeout=30,
            what="every stream's first tokens",
        )
        await manager.remove_engine(source, timeout=0)
        for output in await asyncio.gather(*outputs):
            assert output.finish_reason is FinishReason.LENGTH
            assert output.token_ids == reference
        records = [manager.lifecycle.get(h.request_id) for h in handles]
        assert all(len(r.moves) == 1 and r.moves[0].num_sent_tokens >= 5 for r in records)
        assert all(r.num_output_tokens == 600 for r in records)
    finally:
        await manager.stop()
