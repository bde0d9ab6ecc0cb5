"""`scripts/bench_few_rows.py` smoke runs: the bf16 kernel and the quantized one over the default
model's shapes, one pass each at the generic level (every machine runs it)."""

from __future__ import annotations

import json

import pytest

from tests.scripts import run_script

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("weights", ["bf16", "q4_1"])
def test_few_rows_bench_prints_a_pass(weights: str) -> None:
    args = ["--levels", "generic", "--rows", "1", "--rounds", "1", "--weights", weights]
    result = run_script("bench_few_rows.py", args, timeout=170)
    assert result.returncode == 0, result.stderr
    reference, run = (json.loads(line) for line in result.stdout.splitlines())
    assert reference["weights"] == weights and reference["torch_sum_gb_s"] > 0
    # 30 layers of q/k/v, o, gate/up and down, and the LM head: 134,479,872 weights, at 5 bits
    # a weight in Q4_1's blocks (20 bytes a 32), 16 in bf16
    assert reference["bytes"] * 8 == 134_479_872 * (5 if weights == "q4_1" else 16)
    assert run["level"] == "generic" and run["rows"] == 1
    assert run["gb_s"] > 0 and run["weights_g_s"] > 0
