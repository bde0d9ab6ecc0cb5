"""Running the project's scripts (scripts/) as a user would, for the tests that smoke-run them."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.test_imports import ROOT


def run_script(name: str, args: list[str], timeout: float) -> subprocess.CompletedProcess:
    """scripts/<name> with this interpreter and the checkout on PYTHONPATH; output captured."""
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / name), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
