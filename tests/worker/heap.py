"""Resident memory a step frees but leaves in the heap, measured in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

# Appended to each script: how many kB of resident memory a malloc_trim hands back, which is
# what the script freed but left in the heap.
_TRIMMED_KB = """
import ctypes as _ctypes
from pathlib import Path as _Path

def _anon_kb():
    for line in _Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])

_before = _anon_kb()
_ctypes.CDLL("libc.so.6").malloc_trim(0)
print(_before - _anon_kb())
"""


def freed_but_resident_kb(script: str, *args: str, timeout: float = 300) -> int:
    """Run ``script`` (which keeps what it loads alive) with ``args`` in a fresh interpreter
    from the repository root; the kB a malloc_trim then hands back (glibc only)."""
    result = subprocess.run(
        [sys.executable, "-c", script + _TRIMMED_KB, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert result.returncode == 0, result.stderr
    return int(result.stdout.split()[-1])
