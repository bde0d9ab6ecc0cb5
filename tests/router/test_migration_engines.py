"""Migration over real engines (two in-process engines of a tiny random model, fp32): streams
whose engine dies mid-output go on on the other one, and their tokens are exactly those of
greedy decoding without the move, whether seeded sampling, penalties or a prefix hit."""

from __future__ import annotations

import asyncio

import pytest

from tests.waiting import async_wait_until
from yaied.core.config import load_config
from yaied.core.request import FinishReason, SamplingParams
from yaied.engine.async_engine import AsyncEngine
from yaied.router.config import RouterConfig
from yaied.router.handle import InProcessHandle
from yaied.router.manager import EngineManager

pytestmark = pytest.mark.timeout(60)
PROMPT = list(range(5, 25))  # longer than the long-call threshold: it follows its session's pin


async def two_engines(model: str) -> tuple[EngineManager, list[AsyncEngine]]:
    config = load_config(
        env={},
        overrides={"model": model, "dtype": "float32", "kv_cache_gib": 0.01, "threads": 1},
    )
    engines = [AsyncEngine(config, show_progress=False) for _ in range(2)]
    manager = EngineManager(RouterConfig(long_call_threshold=8), engine_config=config)
    for i, engine in enumerate(engines):
        manager.add_engine(InProcessHandle(str(i), engine))
    manager.inputs = engines[0].inputs
    await manager.start()
    return manager, engines


@pytest.mark.parametrize(
    "knobs",
    [
        dict(temperature=0.0),
        dict(temperature=0.9, seed=11, frequency_penalty=0.7, repetition_penalty=1.3),
    ],
    ids=["greedy", "seeded-penalties"],
)
async def test_streams_of_a_dead_engine_go_on_elsewhere_as_if_nothing_happened(
    tiny_model_dirs, knobs
):
    manager, engines = await two_engines(str(tiny_model_dirs["llama"]))
    try:
        params = SamplingParams(max_tokens=300, ignore_eos=True, **knobs)
        first = await manager.submit_request(session_id="s", prompt=PROMPT, sampling_params=params)
        reference = (await first.result()).token_ids
        assert first.engine_id == "0" and len(reference) == 300
        handles = [
            await manager.submit_request(session_id="s", prompt=PROMPT, sampling_params=params)
            for _ in range(4)
        ]
        assert {h.engine_id for h in handles} == {"0"}
        outputs = [asyncio.create_task(h.result()) for h in handles]
        await async_wait_until(
            lambda: all(c.num_output_tokens >= 5 for c in manager._calls.values()),
            timeout=30,
            what="every stream's first tokens",
        )
        engines[0]._die(RuntimeError("the device fell off the bus"))
        for output in await asyncio.gather(*outputs):
            assert output.finish_reason is FinishReason.LENGTH
            assert output.token_ids == reference
        records = [manager.lifecycle.get(h.request_id) for h in handles]
        assert all(r.engine_id == "1" and len(r.moves) == 1 for r in records)
        assert all(5 <= r.moves[0].num_sent_tokens < 300 for r in records)  # mid-output
        assert manager.migrations == {"moved": 4, "failed": 0}
    finally:
        await manager.stop()
