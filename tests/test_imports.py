"""The engine, the kernels and the offline benchmark import on a box without the server packages
(a GPU box may have only torch, transformers and triton)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVER_PACKAGES = ("starlette", "uvicorn", "sse_starlette", "orjson", "prometheus_client")

BLOCK_SERVER_PACKAGES = f"""
import sys
for name in {SERVER_PACKAGES!r}:
    sys.modules[name] = None  # any import of them now raises ImportError
"""

IMPORT_ENGINE = """
import importlib.util
import yaied
from yaied import LLM, AsyncEngine, SamplingParams
from yaied.engine.async_engine import AsyncEngine as Engine
from yaied.worker.worker import Worker
import yaied.llm, yaied.engine, yaied.kernels, yaied.kernels.cpu_decode
import yaied.kernels.cpu_prefill, yaied.kernels.cpu_fused
if importlib.util.find_spec("triton") is not None:
    import yaied.kernels.triton_decode, yaied.kernels.triton_extend, yaied.kernels.triton_store_kv
    import yaied.worker.gpu_packing, yaied.worker.cuda_graphs
sys.path.insert(0, {scripts!r})
import bench_offline, decode_step, single_stream, hf_baseline
print("ok")
"""


def run_blocked(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", BLOCK_SERVER_PACKAGES + code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def test_engine_kernels_and_bench_import_without_server_packages():
    result = run_blocked(IMPORT_ENGINE.format(scripts=str(ROOT / "scripts")))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_the_block_works():
    result = run_blocked("import starlette")
    assert result.returncode != 0 and "import of starlette halted" in result.stderr
