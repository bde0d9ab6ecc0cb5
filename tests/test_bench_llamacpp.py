"""scripts/bench_llamacpp.py's paired batch-1 runner, with stand-in sides (llama.cpp is not
installed in CI): the two sides alternate, each pair gives a ratio, and a side that dies is
reported with its stderr."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.test_imports import ROOT

pytestmark = pytest.mark.timeout(120)

# Each stand-in logs its runs to the file named where the model path goes.
FAKE_YAIED = """
import json, sys
log = sys.argv[2]
print(json.dumps({"ttft_ms": 1.0, "cpu_isa": "test"}), flush=True)
rates = iter([100.0, 120.0, 80.0])
for _ in sys.stdin:
    open(log, "a").write("yaied\\n")
    print(json.dumps({"decode_tok_s": next(rates)}), flush=True)
"""
FAKE_LLAMA = """
import json, sys
log = sys.argv[1]
print(json.dumps({"ready": True}), flush=True)
rates = iter([50.0, 40.0, 80.0])
for _ in sys.stdin:
    open(log, "a").write("llama\\n")
    print(json.dumps({"ttft_ms": 5.0, "decode_tok_s": next(rates)}), flush=True)
"""


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import bench_llamacpp

    monkeypatch.setattr(bench_llamacpp, "_YAIED_BATCH1", FAKE_YAIED)
    monkeypatch.setattr(bench_llamacpp, "SETTLE_SECONDS", 0.0)
    return bench_llamacpp


def test_the_sides_alternate_and_each_pair_gives_a_ratio(bench, monkeypatch, tmp_path):
    monkeypatch.setattr(bench, "_LLAMA_BATCH1", FAKE_LLAMA)
    log = tmp_path / "log"
    record = bench.paired_batch1(Path(sys.executable), log, 2, "gguf", pairs=3)
    # yaied first in even pairs, llama.cpp first in odd ones
    assert log.read_text().split() == ["yaied", "llama", "llama", "yaied", "yaied", "llama"]
    assert record["pair_ratios"] == [2.0, 3.0, 1.0] and record["ratio"] == 2.0
    assert record["yaied"]["decode_tok_s"] == 100.0 and record["yaied"]["cpu_isa"] == "test"
    assert record["yaied"]["decode_tok_s_runs"] == [100.0, 120.0, 80.0]
    assert record["llama_cpp"] == {
        "decode_tok_s": 50.0, "decode_tok_s_runs": [50.0, 40.0, 80.0], "ttft_ms": 5.0
    }  # fmt: skip


def test_without_llama_cpp_yaied_runs_alone(bench, tmp_path):
    log = tmp_path / "log"
    record = bench.paired_batch1(None, log, 2, "gguf", pairs=2)
    assert log.read_text().split() == ["yaied", "yaied"]
    assert "ratio" not in record and record["yaied"]["decode_tok_s"] == 110.0


def test_a_side_that_dies_is_reported_with_its_stderr(bench, monkeypatch, tmp_path):
    monkeypatch.setattr(bench, "_LLAMA_BATCH1", "import sys; sys.exit('no model here')")
    with pytest.raises(RuntimeError, match="llama.cpp batch 1 failed: no model here"):
        bench.paired_batch1(Path(sys.executable), tmp_path / "log", 2, "gguf", pairs=1)


def test_pairs_below_one_is_a_usage_error(bench, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--pairs", "0"])
    assert exit_info.value.code == 2
    assert "--pairs must be at least 1" in capsys.readouterr().err


def test_the_q4_k_m_shape_without_llama_cpp_is_one_line(bench, monkeypatch, tmp_path):
    """It is quantized by llama.cpp: the file was asked for before llama.cpp was found or
    built, and a machine without it got a traceback."""
    monkeypatch.setenv("YAIED_CACHE_DIR", str(tmp_path))
    with pytest.raises(SystemExit, match="1b-q4_k_m needs llama.cpp"):
        bench.model_file("1b-q4_k_m", None)


def test_a_failed_quantize_leaves_no_2_gb_file_behind(bench, monkeypatch, tmp_path):
    def write_f16(path, source, packed=True):
        path.write_bytes(b"f16")

    monkeypatch.setattr(bench, "write_1b_q4_0", write_f16)
    failing = tmp_path / "python"
    failing.write_text("#!/bin/sh\nexit 3\n")
    failing.chmod(0o755)
    target = tmp_path / "model.gguf"
    with pytest.raises(Exception, match="exit status 3"):
        bench.write_1b_q4_k_m(target, tmp_path / "source.gguf", failing)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["python"]
