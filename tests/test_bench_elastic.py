"""`scripts/bench_router.py --elastic` smoke run: a short ramp on sleep-based fake engines; the
elastic pool scales up, and no call fails."""

from __future__ import annotations

import json

import pytest

from tests.scripts import run_script

pytestmark = pytest.mark.timeout(120)


def test_elastic_bench_short_ramp():
    # One fake engine serves 20 calls/s (4 slots, 10 tokens of 20 ms): the high phase's 40/s
    # piles up calls in half a second. The fake engines sleep, so the ramp does not depend on
    # how busy the machine is.
    args = ["--elastic", "--phases", "0.5,2,1", "--high-rate", "40", "--tokens", "10"]
    args += ["--max-engines", "2", "--window", "0.5", "--cooldown", "0.5", "--idle", "1"]
    args += ["--load-seconds", "0.2"]
    result = run_script("bench_router.py", args, timeout=110)
    assert result.returncode == 0, result.stderr
    pools = [json.loads(line) for line in result.stdout.splitlines()]
    assert [p["pool"] for p in pools] == ["fixed-1", "fixed-2", "elastic-1..2"]
    assert all(p["failed"] == 0 and p["calls"] > 0 for p in pools)
    elastic = pools[-1]
    assert elastic["scale_events"]["up"] >= 1 and elastic["reaction_engine_up_s"] is not None
