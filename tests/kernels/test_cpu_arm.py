"""The generic C bodies on ARM: every kernel cross-compiles for aarch64, and the few-row kernel
runs correctly there (under qemu-aarch64), where the cross toolchain exists (Debian:
gcc-aarch64-linux-gnu, qemu-user); elsewhere these tests skip and say so."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from yaied.kernels.cpu_build import CFLAGS, HERE

CROSS = shutil.which("aarch64-linux-gnu-gcc")
QEMU = shutil.which("qemu-aarch64")
SYSROOT = Path("/usr/aarch64-linux-gnu")
pytestmark = pytest.mark.skipif(
    CROSS is None, reason="no aarch64 cross compiler (Debian: gcc-aarch64-linux-gnu)"
)
KERNELS = sorted(p.name for p in HERE.glob("cpu_*.c"))


@pytest.mark.parametrize("source", KERNELS)
def test_every_kernel_builds_for_aarch64(source, tmp_path):
    command = [CROSS, *CFLAGS, "-DYAIED_ISA_LEVEL=0", f"-I{HERE}", str(HERE / source)]
    done = subprocess.run(
        [*command, "-o", str(tmp_path / "k.so"), "-lm"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.skipif(QEMU is None or not SYSROOT.is_dir(), reason="no qemu-aarch64 (qemu-user)")
def test_few_row_kernel_runs_on_aarch64(tmp_path):
    flags = [flag for flag in CFLAGS if flag not in ("-shared", "-fPIC")]
    binary = tmp_path / "harness"
    harness = Path(__file__).with_name("arm_gemv_harness.c")
    build = [CROSS, *flags, "-DYAIED_ISA_LEVEL=0", f"-I{HERE}", str(harness)]
    done = subprocess.run(
        [*build, str(HERE / "cpu_gemv.c"), "-o", str(binary), "-lm"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    run = subprocess.run(
        [QEMU, "-L", str(SYSROOT), str(binary)], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0 and "ok (0 mismatches)" in run.stdout, run.stdout + run.stderr
