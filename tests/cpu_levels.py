"""CPU kernels for tests, at every ISA level this machine can run (yaied/kernels/cpu_isa.py), so
a machine with AVX512-BF16 tests the AVX-512, AVX2 and generic code too: tests take the
``isa_level`` fixture (tests/conftest.py) and build with ``kernel_at``. A kernel that fails to
build fails its tests (the compiler's message in the error); they skip only where no C compiler
exists or kernels are switched off, and say so."""

from __future__ import annotations

from functools import cache

import pytest

from yaied.kernels.cpu_build import find_compiler, kernels_disabled
from yaied.kernels.cpu_isa import runnable_levels

LEVELS = runnable_levels()


@cache
def built(kind: type, level: str):
    """kind.load(level), strictly: the level itself or an error."""
    return kind.load(level, strict=True)


def kernel_at(kind: type, level: str):
    if kernels_disabled():
        pytest.skip("YAIED_DISABLE_CPU_KERNELS is set: the CPU kernels are not built")
    if find_compiler() is None:
        pytest.skip("no C compiler on this machine: the CPU kernels are not built")
    kernel = built(kind, level)
    assert kernel.level == level
    return kernel
