"""The engine loop hands the heap's freed pages back once a busy spell has gone idle
(yaied/engine/step_loop.py): once per spell, never while a request is in the engine."""

from __future__ import annotations

import asyncio
import platform
import threading

import pytest

from tests.conftest import TINY_CONFIGS, make_tiny_model
from tests.worker.heap import freed_but_resident_kb


class Trims:
    """Counts the engine's idle trims; `settled` once every trim thread started has ended, so
    the count holds each trim the loop decided on so far."""

    def __init__(self) -> None:
        self.calls = 0
        self.happened = threading.Event()

    def __call__(self) -> None:
        self.calls += 1
        self.happened.set()

    async def wait(self) -> None:
        assert await asyncio.to_thread(self.happened.wait, 60), "no idle trim"
        self.happened.clear()

    def settled(self) -> int:
        for thread in threading.enumerate():
            if thread.name == "yaied-trim":
                thread.join()
        return self.calls


async def test_a_busy_spell_is_trimmed_once_when_idle_and_not_before(engine):
    trims = Trims()
    engine.idle_trim, engine.idle_trim_delay_s = trims, 0.0
    stream = engine.generate([1, 2, 3], max_tokens=40, temperature=0.0, ignore_eos=True)
    async for _ in stream:
        assert trims.settled() == 0  # a request in the engine: no trim, whatever the delay
    await trims.wait()
    assert trims.settled() == 1
    # Woken with nothing to do (as an abort of a finished request would): still the same spell.
    engine._wake.set()
    for _ in range(10):
        await asyncio.sleep(0)
    assert trims.settled() == 1
    # The next busy spell gets a trim of its own.
    [e async for e in engine.generate([4, 5], max_tokens=1, temperature=0.0)]
    await trims.wait()
    assert trims.settled() == 2


async def test_no_trim_while_a_request_waits_outside_the_scheduler(engine):
    """A constrained request compiling its grammar is in the engine, not yet scheduled: the
    loop is idle but work waits, so no trim until it has run."""
    trims = Trims()
    engine.idle_trim, engine.idle_trim_delay_s = trims, 0.0
    [e async for e in engine.generate([1, 2], max_tokens=1, temperature=0.0)]
    await trims.wait()  # the spell before ends with its trim
    engine._trim_due = True  # as after a step
    engine._streams["waiting"] = object()  # a request the scheduler has not been given yet
    try:
        engine._wake.set()
        for _ in range(10):
            await asyncio.sleep(0)
        assert trims.settled() == 1
    finally:
        del engine._streams["waiting"]


# The engine, a burst of long prompts through its loop, then idle until it has trimmed; the
# heap helper then counts what a further malloc_trim would still hand back. Before the idle trim
# it waits in vain and finds the burst's freed activations resident.
_BURST = """
import asyncio, sys, threading
from yaied.core.config import load_config
from yaied.engine.async_engine import AsyncEngine

config = load_config(overrides={
    "model": sys.argv[1], "dtype": "float32", "kv_cache_gib": 0.1,
    "max_model_len": 2048, "max_num_batched_tokens": 1024,
})
engine = AsyncEngine(config, show_progress=False)
trimmed = threading.Event()
trim = getattr(engine, "idle_trim", lambda: None)
engine.idle_trim = lambda: (trim(), trimmed.set())
engine.idle_trim_delay_s = 0.0

async def burst():
    async def one(seed):
        prompt = [(seed * 7 + i) % 200 + 5 for i in range(1024)]
        return [e async for e in engine.generate(prompt, max_tokens=2, ignore_eos=True)]
    await asyncio.gather(*(one(seed) for seed in range(4)))
    await asyncio.to_thread(trimmed.wait, 30)
    for thread in threading.enumerate():
        if thread.name == "yaied-trim":
            thread.join()

asyncio.run(burst())
"""

# Wide enough that a 1024-token step's activations (8 MiB a tensor) outgrow the heap's scraps.
_WIDE = {
    "wide": dict(
        TINY_CONFIGS["llama"],
        hidden_size=512,
        intermediate_size=2048,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
    )
}


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_a_burst_does_not_stay_resident_once_idle(tmp_path):
    """After four 1024-token prompts 13 MB of freed activations stayed in the heap, resident
    for as long as the engine idled (a daemon: 40 MB after a burst of chats and embeddings)."""
    folder = make_tiny_model("wide", tmp_path / "wide", configs=_WIDE)
    assert freed_but_resident_kb(_BURST, str(folder)) < 4 * 1024  # kB
