"""The one place that knows the CPU: which instruction-set levels yaied has kernel code for, which
of them this CPU runs, and the cap ``YAIED_CPU_ISA`` that lowers the choice.

The levels, lowest first (each includes the ones before it):

- ``generic``: plain C, built without -march: any CPU with a C compiler (ARM included).
- ``avx2``: AVX2 + FMA + F16C (x86-64-v3: Haswell on, every Zen).
- ``avx512``: AVX-512 F/BW/VL/DQ (x86-64-v4: Skylake-SP to Ice Lake, Zen 4).
- ``avx512_bf16``: AVX-512 with BF16 dot products (Cooper Lake, Sapphire Rapids with AMX, Zen 4).

Each C kernel is built once per level it is asked for (cpu_build.py) with that level's flags,
and its source picks its bodies by the compiler's macros (``__AVX512BF16__``, ``__AVX2__``...).
The level also decides the default math dtype (yaied/worker/loader.py): bf16 math pays only with
bf16 dot products; elsewhere weights stay bf16 in memory and the math is fp32.

The cap can only lower the level: a CPU never gets code it cannot run. It lets any machine test
the lower levels' code (tests/kernels run every level the machine can run).
"""

from __future__ import annotations

import os
import platform
from functools import cache
from pathlib import Path

LEVELS = ("generic", "avx2", "avx512", "avx512_bf16")
ENV_CAP = "YAIED_CPU_ISA"

# The /proc/cpuinfo flags each x86 level needs, on top of the level below.
_REQUIRED_FLAGS = {
    "generic": frozenset(),
    "avx2": frozenset({"avx", "avx2", "fma", "f16c", "bmi2"}),
    "avx512": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"}),
    "avx512_bf16": frozenset({"avx512_bf16"}),
}

# Compiler flags per level below the CPU's own. x86-64-v3/v4 are the psABI levels (gcc >= 11,
# clang >= 12); tuning follows this CPU, which changes no instruction the level may use.
_LEVEL_FLAGS = {
    "generic": (),
    "avx2": ("-march=x86-64-v3",),
    "avx512": ("-march=x86-64-v4",),
    "avx512_bf16": ("-march=x86-64-v4", "-mavx512bf16"),
}


class IsaError(ValueError):
    """A cap that names no level, or a level above what the CPU has."""


def level_rank(level: str) -> int:
    return LEVELS.index(level)


def compiler_flags(level: str) -> tuple[str, ...]:
    """The flags that build a kernel for ``level``. The CPU's own level is built for the CPU
    itself (-march=native: its tuning, and any extension beyond the level that the compiler
    finds a use for); a lower level, asked for by the cap, gets the portable level flags, so
    that its code is what a CPU of that level would run."""
    if not _is_x86():
        return ()
    if level == detected_level():
        return ("-march=native",)
    flags = portable_flags(level)
    return (*flags, "-mtune=native") if flags else ()


def portable_flags(level: str) -> tuple[str, ...]:
    """The extensions ``level`` promises and nothing more (x86): what a kernel may use without
    a check of its own. -march=native may offer more (AVX512-VBMI on a Zen 4, not on a Cooper
    Lake of the same level), so a kernel using more guards it."""
    return _LEVEL_FLAGS[level]


@cache
def cpu_features() -> frozenset[str]:
    """This CPU's feature names: /proc/cpuinfo's ``flags`` (x86) or ``Features`` (ARM) line."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def detected_level(features: frozenset[str] | None = None) -> str:
    """The highest level this CPU runs (``generic`` off x86)."""
    if not _is_x86():
        return "generic"
    have = cpu_features() if features is None else features
    best = "generic"
    for level in LEVELS[1:]:
        if not _REQUIRED_FLAGS[level] <= have:
            break
        best = level
    return best


def selected_level(environ: dict[str, str] | None = None) -> str:
    """The level kernels are built and chosen for: the CPU's, lowered by YAIED_CPU_ISA.
    Raises IsaError, with one line naming what the CPU supports, for a bad cap."""
    env = os.environ if environ is None else environ
    detected = detected_level()
    cap = env.get(ENV_CAP, "").strip().lower()
    if not cap:
        return detected
    runnable = ", ".join(runnable_levels())
    if cap not in LEVELS:
        raise IsaError(
            f"{ENV_CAP}={cap!r} is not a level ({', '.join(LEVELS)}); this CPU runs: {runnable}"
        )
    if level_rank(cap) > level_rank(detected):
        raise IsaError(f"{ENV_CAP}={cap} is above what this CPU supports; it runs: {runnable}")
    return cap


def runnable_levels() -> tuple[str, ...]:
    """Every level this CPU runs, lowest first."""
    return LEVELS[: level_rank(detected_level()) + 1]


def has_bf16_math(level: str) -> bool:
    """Whether bf16 matmuls and dot products are fast at ``level`` (else fp32 math is)."""
    return level == "avx512_bf16"


def torch_caps(level: str) -> dict[str, str]:
    """Environment variables that hold torch's own CPU kernels (ATen, oneDNN) to ``level``, for
    a process started with a cap (benchmarks of a lower level on a higher CPU). They take effect
    only if set before torch loads."""
    onednn = {"generic": "SSE41", "avx2": "AVX2", "avx512": "AVX512_CORE"}
    aten = {"generic": "default", "avx2": "avx2", "avx512": "avx512"}
    mkl = {"generic": "SSE4_2", "avx2": "AVX2", "avx512": "AVX512"}  # fp32 matmuls: MKL's sgemm
    if level not in onednn or not _is_x86():
        return {}
    return {
        "ONEDNN_MAX_CPU_ISA": onednn[level],
        "ATEN_CPU_CAPABILITY": aten[level],
        "MKL_ENABLE_INSTRUCTIONS": mkl[level],
    }


def hold_torch_to_cap(environ: dict[str, str] | None = None) -> str:
    """The selected level (IsaError for a bad cap); where the cap lowers it, torch's own
    kernels are held to it too (``torch_caps``, unless their variables are already set), so
    that a capped run does what a CPU of that level does. Call before torch loads."""
    env = os.environ if environ is None else environ
    level = selected_level(env)
    if level != detected_level():
        for name, value in torch_caps(level).items():
            env.setdefault(name, value)
    return level


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")
