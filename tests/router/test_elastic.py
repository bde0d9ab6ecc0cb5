"""The elastic pool over real engine processes (tiny model, CPU): an engine added under load takes
calls; the first one drained and removed with 8 streams open on it loses none of them, frees its
pages and its process; a session whose KV lived there continues on the other engine."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from yaied.core.config import load_config
from yaied.core.request import FinishReason, SamplingParams
from yaied.router.build import build_manager
from yaied.router.config import EngineEntry, RouterConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
LONG_CALL = 16  # prompts longer than this follow their session's pin


async def wait_for(predicate, timeout: float = 60.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "timed out waiting"
        await asyncio.sleep(0.05)


async def test_add_then_drain_and_remove_the_first_engine_under_load(tiny_model_dirs):
    engine_config = load_config(
        env={}, overrides={"model": str(tiny_model_dirs["llama"]), "kv_cache_gib": 0.01}
    )
    router = RouterConfig(long_call_threshold=LONG_CALL)
    manager = build_manager(engine_config, router, (EngineEntry(device="cpu", threads=1),))
    await manager.start()
    first = manager.handles["0"]
    greedy = dict(temperature=0, ignore_eos=True)
    results: list[tuple[str, FinishReason]] = []  # the background load: (engine, finish)
    stop_load = asyncio.Event()

    async def load() -> None:
        while not stop_load.is_set():
            handle = await manager.submit_request(
                prompt=[1, 2, 3], sampling_params=SamplingParams(max_tokens=6, **greedy)
            )
            output = await handle.result()
            results.append((handle.engine_id, output.finish_reason))

    loaders = [asyncio.create_task(load()) for _ in range(2)]
    try:
        # A session's context on engine 0, before there is any other.
        context = list(range(1, LONG_CALL + 20))
        turn = await manager.submit_request(
            session_id="kv", prompt=context, sampling_params=SamplingParams(max_tokens=4, **greedy)
        )
        assert (await turn.result()).finish_reason is FinishReason.LENGTH
        assert turn.engine_id == "0" and manager.coordinator.pin_of("kv") == "0"

        second = manager.add_engine(EngineEntry(device="cpu", threads=1, name="second"))
        assert manager.engine_state(second) == "starting"
        assert await manager.wait_started(second) == "up"
        await wait_for(lambda: any(engine == second for engine, _ in results))

        # 8 streams of the session, all on its pinned engine 0.
        params = SamplingParams(max_tokens=40, **greedy)
        streams = [
            await manager.submit_request(session_id="kv", prompt=context, sampling_params=params)
            for _ in range(8)
        ]
        assert {s.engine_id for s in streams} == {"0"}
        await wait_for(lambda: manager.num_calls_waiting <= 2)  # they are streaming
        manager.drain_engine("0")
        outputs = await asyncio.gather(*(s.result() for s in streams))
        assert [o.finish_reason for o in outputs] == [FinishReason.LENGTH] * 8
        assert all(len(o.token_ids) == 40 for o in outputs)
        stats = lambda: first.stats() or {}  # noqa: E731
        await wait_for(lambda: stats().get("num_free_pages") == stats().get("num_pages"))
        process = first.process
        await manager.remove_engine("0", timeout=30)
        assert not process.is_alive() and manager.engine_state("0") == "removed"

        # The session goes on where it can: engine "second" builds its cache there.
        turn = await manager.submit_request(
            session_id="kv",
            prompt=context + [7] * 8,
            sampling_params=SamplingParams(max_tokens=4, **greedy),
        )
        assert (await turn.result()).finish_reason is FinishReason.LENGTH
        assert turn.engine_id == second
    finally:
        stop_load.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.gather(*loaders), 30)
        await manager.stop()
    assert results and all(reason is FinishReason.LENGTH for _, reason in results)
    assert {engine for engine, _ in results} == {"0", second}
