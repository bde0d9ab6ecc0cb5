"""A tensor-parallel rank that dies or hangs ends its engine cleanly: the calls in flight get
error events (never a hang), the engine reports itself dead (so a supervisor or the router
restarts it), and no rank process is left once the engine stops."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from yaied.core.config import load_config
from yaied.core.request import FinishReason, SamplingParams
from yaied.engine.async_engine import AsyncEngine

LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)


def alive(pid: int) -> bool:
    """Running, not a zombie (a rank killed but not yet reaped is gone for our purposes)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def start_engine(folder, **overrides) -> AsyncEngine:
    values = {"model": str(folder), "dtype": "float32", "tensor_parallel_size": 2}
    values |= {"kv_cache_gib": 0.01, "max_model_len": 512} | overrides
    config = load_config(env={}, overrides=values)
    return await asyncio.to_thread(AsyncEngine, config, show_progress=False)


async def run_until_final(engine: AsyncEngine, on_first_token) -> tuple[object, float]:
    """Stream one long call; call ``on_first_token`` once tokens flow; the final event and the
    seconds from the fault to it."""
    fault_at = None
    async for event in engine.generate([1, 2, 3, 4], LONG):
        if fault_at is None and event.token_ids:
            on_first_token()
            fault_at = time.monotonic()
        if event.finished:
            return event, time.monotonic() - fault_at


@pytest.mark.timeout(120)
async def test_a_killed_rank_fails_the_calls_and_ends_the_engine(tiny_model_dirs):
    engine = await start_engine(tiny_model_dirs["llama"])
    pids = engine.worker.parallel.pids
    dead: list[BaseException] = []
    engine.on_dead = dead.append
    try:
        final, seconds = await run_until_final(engine, lambda: os.kill(pids[0], signal.SIGKILL))
        assert final.finish_reason is FinishReason.ERROR
        assert "tensor-parallel" in final.error
        assert seconds < 10
        assert dead and engine.dead is not None
        with pytest.raises(RuntimeError, match="stopped"):
            engine.add_request([1, 2], LONG, sink=lambda event: None)
    finally:
        await engine.shutdown()
    assert not any(alive(pid) for pid in pids)


@pytest.mark.timeout(120)
async def test_a_hung_rank_times_out_but_an_idle_one_does_not(tiny_model_dirs):
    """SIGSTOP: the rank holds its sockets open and answers nothing; rank 0's collective gives
    up after the group's timeout (engine.step_timeout_s). Ranks waiting for work through a
    longer idle spell stay."""
    engine = await start_engine(tiny_model_dirs["llama"], step_timeout_s=3.0)
    pids = engine.worker.parallel.pids
    try:
        await asyncio.sleep(4)  # idle past the timeout: waiting for work is no fault
        events = [e async for e in engine.generate([5, 6, 7], SamplingParams(max_tokens=3))]
        assert events[-1].finish_reason is FinishReason.LENGTH
        final, seconds = await run_until_final(engine, lambda: os.kill(pids[0], signal.SIGSTOP))
        assert final.finish_reason is FinishReason.ERROR
        assert seconds < 15
        assert engine.dead is not None
    finally:
        await engine.shutdown()  # kills the stopped rank too
    assert not any(alive(pid) for pid in pids)


@pytest.mark.timeout(120)
async def test_shutdown_leaves_no_rank(tiny_model_dirs):
    engine = await start_engine(tiny_model_dirs["llama"])
    pids = engine.worker.parallel.pids
    events = [e async for e in engine.generate([5, 6, 7], SamplingParams(max_tokens=3))]
    assert events[-1].finish_reason is FinishReason.LENGTH
    assert all(alive(pid) for pid in pids)
    await engine.shutdown()
    assert not any(alive(pid) for pid in pids)
