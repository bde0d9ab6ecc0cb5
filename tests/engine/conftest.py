"""The engine the engine tests share: a tiny random Llama in fp32, a small KV pool and 32-token
steps, one per test module. A module that needs another engine defines its own ``engine``."""

from __future__ import annotations

import pytest

from yaied.core.config import load_config
from yaied.engine.async_engine import AsyncEngine


@pytest.fixture(scope="module")
def engine(tiny_model_dirs):
    config = load_config(
        overrides={
            "model": str(tiny_model_dirs["llama"]),
            "dtype": "float32",
            "kv_cache_gib": 0.01,
            "max_num_batched_tokens": 32,
        }
    )
    eng = AsyncEngine(config, show_progress=False)
    yield eng
    eng._executor.shutdown()
