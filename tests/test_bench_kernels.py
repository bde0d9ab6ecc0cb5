"""`scripts/bench_kernels.py --decode-only` smoke run: every decode case prints a time, the
in-cache case among them."""

from __future__ import annotations

import json

import pytest

from tests.scripts import run_script

pytestmark = pytest.mark.timeout(180)


def test_decode_cases_print_their_times() -> None:
    result = run_script(
        "bench_kernels.py", ["--decode-only", "--dtype", "bfloat16", "--rounds", "1"], 170
    )
    assert result.returncode == 0, result.stderr
    cases = [json.loads(line) for line in result.stdout.splitlines()]
    assert [c["case"].rpartition(", ")[2] for c in cases] == ["from memory"] * 3 + [
        "one layer's K/V in cache"
    ]
    assert all(c["ms"] > 0 and c["kv_gb_s"] > 0 for c in cases)
