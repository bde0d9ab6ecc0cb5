"""scripts/bench_offline.py smoke runs on CPU with a tiny dummy config, the server packages
blocked: W-nano (cut down) against transformers, and the batch-1 decode-step mode."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TINY_CONFIGS
from tests.test_imports import BLOCK_SERVER_PACKAGES, ROOT

SCRIPT = ROOT / "scripts" / "bench_offline.py"
RUN_SCRIPT = """
import runpy
sys.argv = {argv!r}
sys.path.insert(0, {scripts!r})
runpy.run_path({script!r}, run_name="__main__")
"""


def run_bench(tmp_path: Path, *args: str) -> list[dict]:
    config = dict(TINY_CONFIGS["llama"], max_position_embeddings=4096)
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(config))
    argv = [str(SCRIPT), "--model", str(path), "--load-format", "dummy", "--dtype", "float32"]
    argv += ["--threads", "1", "--kv-cache-gib", "0.05", *args]
    code = RUN_SCRIPT.format(argv=argv, scripts=str(ROOT / "scripts"), script=str(SCRIPT))
    result = subprocess.run(
        [sys.executable, "-c", BLOCK_SERVER_PACKAGES + code],
        capture_output=True,
        text=True,
        timeout=170,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines()]


@pytest.mark.timeout(180)
def test_w_nano_smoke_with_compare_hf(tmp_path):
    (record,) = run_bench(
        tmp_path, "--workload", "W-nano", "--num-prompts", "2", "--max-output-len", "6",
        "--compare-hf", "--no-peak",
    )  # fmt: skip
    assert record["workload"] == "W-nano" and record["num_requests"] == 2
    assert record["output_tokens"] == 12
    assert 200 <= record["prompt_tokens"] <= 2 * 1024  # W-nano prompts are 100..1024 tokens
    assert record["output_tok_s"] > 0 and record["hf_output_tok_s"] > 0 and record["ratio"] > 0
    # what it ran on, in every line; transformers in whichever dtype its probe found faster
    assert record["cpu_isa"] and record["copy_bandwidth_gb_s"] > 0 and record["cpu"]
    assert record["math_dtype"] == "float32" and record["weight_dtype"] == "float32"
    probe = record["hf_probe_s"]
    assert set(probe) == {"bfloat16", "float32"}
    assert probe[record["hf_dtype"]] == min(probe.values())  # a tie may go either way


@pytest.mark.timeout(180)
def test_decode_step_mode(tmp_path):
    (record,) = run_bench(tmp_path, "--decode-step", "--decode-steps", "4")
    assert record["mode"] == "decode-step" and record["batch_size"] == 1
    assert record["step_ms"] > 0 and record["weight_bytes"] > 0
    assert "memory_floor_ms" not in record  # a CPU has no spec bandwidth in the table


def test_spec_bandwidth_by_device_name():
    spec = importlib.util.spec_from_file_location("decode_step", ROOT / "scripts/decode_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.spec_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert module.spec_bandwidth("NVIDIA H200") == 4.8e12
    assert module.spec_bandwidth("NVIDIA A100-SXM4-80GB") is None


@pytest.mark.timeout(180)
def test_w_single_with_compare_hf(tmp_path):
    (record,) = run_bench(tmp_path, "--workload", "W-single", "--compare-hf", "--no-peak")
    assert record["workload"] == "W-single" and record["output_tokens"] == 256
    assert record["ttft_ms"] > 0 and record["decode_tok_s"] > 0 and record["hf_decode_tok_s"] > 0
    assert record["copy_bandwidth_gb_s"] > 0 and record["memory_floor_tok_s"] > 0
    assert len(record["floor_bandwidth_gb_s"]) == 2 and min(record["floor_bandwidth_gb_s"]) > 0
    assert record["weight_bytes"] > 0 and record["kv_bytes_per_token"] > 0


@pytest.mark.timeout(180)
def test_tensor_parallel_reports_communication_per_step(tmp_path):
    (record,) = run_bench(
        tmp_path, "--workload", "W-mixed", "--num-prompts", "2", "--max-output-len", "4",
        "--tensor-parallel-size", "2", "--no-peak",
    )  # fmt: skip
    assert record["output_tokens"] == 8
    assert record["comm_ms_per_step"] > 0 and 0 < record["comm_share"] < 1
    # two all-reduces a layer (2 layers), the embedding's, the step and the logits commands
    assert record["collectives_per_step"] >= 5


def test_speculative_compare_mode(tmp_path):
    lines = run_bench(
        tmp_path, "--workload", "W-mixed", "--num-prompts", "2", "--max-output-len", "6",
        "--speculative-compare", "--no-peak",
    )  # fmt: skip
    runs, (summary,) = lines[:-1], lines[-1:]
    assert [r["speculative"] for r in runs] == [False, True]
    assert all(r["output_tokens"] == 12 and r["decode_tok_s"] > 0 for r in runs)
    assert summary["summary"] and summary["outputs_identical"] and summary["speedup"] > 0
