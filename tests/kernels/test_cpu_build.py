"""Building the CPU kernels: a failed build says what the compiler said and falls back a level
(strict builds raise); the cache key follows the flags and the compiler; a cached library that
does not load is built again."""

from __future__ import annotations

import logging
import platform
import subprocess
from pathlib import Path

import pytest

from yaied.kernels import cpu_build
from yaied.kernels.cpu_build import KernelBuildError, find_compiler, load_library
from yaied.kernels.cpu_isa import LEVELS, portable_flags

pytestmark = pytest.mark.skipif(find_compiler() is None, reason="no C compiler on this machine")

GOOD = '#include "cpu_common.h"\nint answer(void) { return 42; }\n'
# Compiles only where the level's macros say AVX2 is off: a kernel that builds at generic only.
GENERIC_ONLY = GOOD + "#ifdef __AVX2__\n#error this body does not build with AVX2\n#endif\n"


def write(tmp_path: Path, text: str) -> Path:
    source = tmp_path / "probe_kernel.c"
    source.write_text(text)
    return source


def test_builds_and_reports_its_level(tmp_path):
    library = load_library(write(tmp_path, GOOD), "generic", tmp_path, strict=True)
    assert library.level == "generic" and library.cdll.answer() == 42
    assert library.cdll.yaied_isa_level() == 0


def test_strict_build_failure_carries_the_compilers_message(tmp_path):
    source = write(tmp_path, "int broken(void) { return undeclared_name; }\n")
    with pytest.raises(KernelBuildError, match="undeclared_name"):
        load_library(source, "generic", tmp_path, strict=True)


def test_a_failed_level_falls_back_with_one_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(cpu_build, "compiler_flags", lambda level: _portable(level))
    source = write(tmp_path, GENERIC_ONLY)
    with caplog.at_level(logging.WARNING, logger="yaied.kernels.cpu_build"):
        library = load_library(source, "avx2", tmp_path)
    assert library is not None and library.level == "generic"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "does not build with AVX2" in warnings[0].getMessage()


def test_nothing_builds_means_no_kernel(tmp_path, caplog):
    source = write(tmp_path, "this is not C\n")
    assert load_library(source, "generic", tmp_path) is None


def test_cache_key_follows_flags_and_compiler(tmp_path, monkeypatch):
    source = write(tmp_path, GOOD)
    compiler = find_compiler()
    generic = cpu_build._target(compiler, source, "generic", tmp_path)
    assert generic != cpu_build._target(compiler, source, "avx2", tmp_path)
    monkeypatch.setattr(cpu_build, "_compiler_identity", lambda c: "another compiler 99")
    assert generic != cpu_build._target(compiler, source, "generic", tmp_path)


def test_a_cached_library_that_does_not_load_is_rebuilt(tmp_path):
    source = write(tmp_path, GOOD)
    target = cpu_build._target(find_compiler(), source, "generic", tmp_path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(b"not an ELF file")  # a truncated copy, or another machine's
    library = load_library(source, "generic", tmp_path, strict=True)
    assert library.cdll.answer() == 42


def test_disabled_kernels_build_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("YAIED_DISABLE_CPU_KERNELS", "1")
    assert load_library(write(tmp_path, GOOD), "generic", tmp_path) is None


def _portable(level: str) -> tuple[str, ...]:
    return {"generic": (), "avx2": ("-mavx2", "-mfma")}.get(level, ())


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86's levels")
@pytest.mark.parametrize("level", LEVELS[1:])
def test_every_kernel_compiles_with_only_its_levels_extensions(tmp_path, level):
    """The CPU's own level is built with -march=native, which may enable more than the level
    promises (AVX512-VBMI on a Zen 4): each kernel must also compile for a CPU with the level's
    extensions only (a Cooper Lake at avx512_bf16), where a missing guard would cost it the
    level. Compile only and unoptimised: the intrinsics' target checks are what is tested."""
    compiler = find_compiler()
    for source in sorted(cpu_build.HERE.glob("*.c")):
        output = tmp_path / f"{source.stem}.o"
        flags = ["-O0", "-c", "-fopenmp", *portable_flags(level)]
        flags.append(f"-DYAIED_ISA_LEVEL={LEVELS.index(level)}")
        command = [compiler, *flags, f"-I{cpu_build.HERE}", str(source), "-o", str(output)]
        result = subprocess.run(command, capture_output=True, text=True)
        assert result.returncode == 0, f"{source.name} at {level}: {result.stderr[-3000:]}"
