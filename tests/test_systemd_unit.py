"""The systemd unit: Type=notify with a watchdog, sandboxed, and valid where systemd can check."""

from __future__ import annotations

import configparser
import shutil
import subprocess
from pathlib import Path

import pytest

UNIT = Path(__file__).resolve().parent.parent / "systemd" / "yaied.service"


def read_unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # systemd keys are case-sensitive
    parser.read(UNIT)
    return parser


def test_unit_declares_notify_watchdog_and_sandbox():
    service = read_unit()["Service"]
    assert service["Type"] == "notify"
    assert "yaied serve" in service["ExecStart"]
    assert int(service["WatchdogSec"]) > 0
    assert service["Restart"] == "on-failure"
    for key in ("NoNewPrivileges", "ProtectSystem", "PrivateTmp", "CacheDirectory"):
        assert key in service
    assert "YAIED_CACHE_DIR=%C/yaied" in service["Environment"]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not found")
def test_systemd_analyze_verify_accepts_the_unit():
    result = subprocess.run(
        ["systemd-analyze", "verify", str(UNIT)], capture_output=True, text=True, timeout=60
    )
    # The ExecStart binary only exists once installed; every other complaint is a failure.
    problems = [
        line
        for line in result.stderr.splitlines()
        if line.strip() and "/opt/yaied/.venv/bin/yaied" not in line
    ]
    assert not problems, result.stderr
