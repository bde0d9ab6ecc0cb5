"""scripts/soak.py --short end to end: a launched daemon under mixed load, disconnects, cancels and
bursts past the queue limit; afterwards nothing lost or hung, every KV page back, /health 200."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server.conftest import default_model_available

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "soak.py"


@pytest.mark.slow  # a daemon on the default model under load for about a minute
@pytest.mark.timeout(240)
@pytest.mark.skipif(not default_model_available(), reason="needs the default model's tokenizer")
def test_short_soak_loses_nothing_and_returns_every_page():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--short"], capture_output=True, text=True, timeout=230
    )
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["passed"] and not summary["failures"]
    outcomes = summary["outcomes"]
    assert outcomes["ok"] > 50
    assert outcomes.get("disconnected", 0) > 0 and outcomes.get("cancelled", 0) > 0
    assert not outcomes.get("hung") and not outcomes.get("broken")
    assert not outcomes.get("server_error")
    assert summary["errors_by_kind"].get("429 queue_full", 0) > 0  # the bursts hit the limit
    assert summary["kv_usage_after"] == 0 and summary["in_flight_after"] == 0
    assert summary["health_after"] == 200 and summary["exit_code"] == 0
