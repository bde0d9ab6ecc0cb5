"""The engine imports on a box without the server packages (a GPU box may have only torch)."""

from __future__ import annotations

import subprocess
import sys

BLOCK_SERVER_PACKAGES = """
import sys
for name in ("starlette", "uvicorn", "sse_starlette", "orjson", "prometheus_client"):
    sys.modules[name] = None  # any import of them now raises ImportError
import yaied
from yaied import LLM, AsyncEngine, SamplingParams
from yaied.engine.async_engine import AsyncEngine as Engine
from yaied.worker.worker import Worker
print("ok")
"""


def test_engine_imports_without_server_packages():
    result = subprocess.run(
        [sys.executable, "-c", BLOCK_SERVER_PACKAGES], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
