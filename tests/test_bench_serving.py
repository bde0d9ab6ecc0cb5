"""scripts/bench_serving.py end to end against a launched daemon serving a tiny random model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson

from tests.conftest import make_tiny_model

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_serving.py"


def run_bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120
    )


def test_bench_serving_launch_random(tmp_path):
    folder = make_tiny_model("llama", tmp_path / "llama")
    done = run_bench(
        "--launch",
        "--model",
        str(folder),
        "--dtype",
        "float32",
        "--serve-args",
        "--kv-cache-gib 0.05 --max-model-len 1024 --threads 1",
        "--input-len-min",
        "8",
        "--input-len-max",
        "24",
        "--output-len",
        "6",
        "--num-prompts",
        "6",
        "--max-concurrency",
        "3",
        "--request-rate",
        "50",
        "--runs",
        "2",
        "--compare-hf",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    first, record = (orjson.loads(line) for line in done.stdout.strip().splitlines())
    assert (first["seed"], record["seed"]) == (0, 1)  # fresh prompts each run
    # transformers timed after each run, beside it: every line has its own ratio
    assert all(r["hf_output_tok_s"] > 0 and r["ratio"] > 0 for r in (first, record))
    assert record["hf_dtype"] in ("bfloat16", "float32")  # its faster on this machine
    # what it ran on, from the daemon's /health and this process
    assert record["cpu_isa"] and record["dtype"] == "float32" and record["copy_bandwidth_gb_s"] > 0
    assert record["num_requests"] == record["completed"] == 6 and record["failed"] == 0
    assert record["total_output_tokens"] == 36
    assert record["output_throughput"] > 0
    # No tokenizer: no text, so the server sends only each request's final chunk and there is
    # no inter-chunk gap to measure (itl is None); the other figures are all there.
    for name in ("ttft_ms", "tpot_ms", "e2e_ms"):
        for stat in ("mean", "median", "p99"):
            assert record[f"{stat}_{name}"] is not None and record[f"{stat}_{name}"] >= 0
    assert record["p99_e2e_ms"] >= record["mean_ttft_ms"] > 0


def test_bench_serving_refuses_non_loopback():
    done = run_bench("--base-url", "http://192.0.2.1:8000", "--vocab-size", "10")
    assert done.returncode == 2
    assert "non-loopback" in done.stderr and done.stdout == ""
