"""An in-process engine removed from the pool gives its memory back at once: the daemon froze
everything loaded (core/processes.py), so without a collection of its own the removed engine
(weights, KV pool) stays alive until some later full collection, and what it freed stays in
the C heap, where the daemon's RSS keeps it (the soak saw a daemon hold 1.1 GiB after its one
in-process engine was replaced by an engine process)."""

from __future__ import annotations

import gc
import weakref

import pytest

from yaied.core import processes
from yaied.core.config import load_config
from yaied.core.processes import freeze_loaded_objects
from yaied.engine.async_engine import AsyncEngine
from yaied.router.config import RouterConfig
from yaied.router.handle import InProcessHandle
from yaied.router.manager import EngineManager

pytestmark = pytest.mark.timeout(60)


async def test_a_removed_in_process_engine_is_freed_and_its_heap_trimmed(
    tiny_model_dirs, monkeypatch
):
    trims: list[bool] = []
    monkeypatch.setattr(processes, "_trim_heap", lambda: trims.append(True), raising=False)
    config = load_config(
        env={},
        overrides={"model": str(tiny_model_dirs["llama"]), "kv_cache_gib": 0.01, "threads": 1},
    )
    first = AsyncEngine(config, show_progress=False)
    manager = EngineManager.single(first, RouterConfig())
    manager.add_engine(InProcessHandle("1", AsyncEngine(config, show_progress=False)))
    freeze_loaded_objects()  # as the daemon does once loaded
    try:
        await manager.start()
        gone = weakref.ref(first)
        del first
        await manager.remove_engine("0", timeout=1)
        assert gone() is None  # no gc.collect() here: the stop itself let it go
        assert trims
    finally:
        gc.unfreeze()
        await manager.stop()
