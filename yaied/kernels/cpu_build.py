"""Compiling and loading the CPU kernels (yaied/kernels/*.c) with the system C compiler.

Each kernel is a self-contained C file (plus the shared headers cpu_*.h) built on first use into
the yaied cache folder and loaded with ctypes: no torch headers, so a build takes about a second.
A kernel is built for one ISA level (cpu_isa.py) at a time, with that level's flags; a build that
fails at one level falls back to the next lower one with a warning that carries the compiler's
own message, so the engine serves with the best code that builds. A machine without a compiler
keeps the torch paths (``load_library`` returns None).

The cache key covers the sources, the flags, the compiler and its version, and this CPU's
features (on every architecture), so a library is never reused where it could not run; a cached
library that fails to load is built again, and a file lock keeps tensor-parallel ranks and
engine processes from compiling the same library at once.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path
from typing import NamedTuple

from yaied.kernels.cpu_isa import LEVELS, compiler_flags, cpu_features, level_rank, selected_level

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
# Every header a kernel may include (the cache key covers them all, so editing one rebuilds).
HEADERS = sorted(HERE.glob("cpu_*.h"))
# -fassociative-math lets the compiler vectorise the dot-product reductions; infinities stay
# legal (the online softmax starts from -inf), so no -ffast-math.
CFLAGS = [
    "-O3",
    "-shared",
    "-fPIC",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fno-signed-zeros",
    "-fassociative-math",
    "-fopenmp",
    "-Wno-psabi",  # GCC's vector types in static functions of one library: no ABI to keep
]


class KernelBuildError(RuntimeError):
    """A kernel that did not compile or load; the message carries the compiler's output."""


class KernelLibrary(NamedTuple):
    cdll: ctypes.CDLL
    level: str  # the ISA level it was built for (cpu_isa.LEVELS)


def find_compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def kernels_disabled() -> bool:
    return bool(os.environ.get("YAIED_DISABLE_CPU_KERNELS"))


def load_library(
    source: Path, level: str | None = None, cache_dir: Path | None = None, *, strict: bool = False
) -> KernelLibrary | None:
    """``source`` built for ``level`` (default: the selected level, cpu_isa.selected_level), or
    for the highest lower level that builds. None where kernels are disabled, no compiler exists
    or no level builds. ``strict`` (tests): build exactly ``level`` and raise KernelBuildError
    if it fails."""
    if kernels_disabled():
        return None
    compiler = find_compiler()
    if compiler is None:
        log.info("no C compiler found: %s is replaced by the torch path", source.name)
        return None
    wanted = level or selected_level()
    if strict:
        return KernelLibrary(_build_and_load(compiler, source, wanted, cache_dir), wanted)
    for candidate in reversed(LEVELS[: level_rank(wanted) + 1]):
        try:
            return KernelLibrary(_build_and_load(compiler, source, candidate, cache_dir), candidate)
        except KernelBuildError as exc:
            log.warning("CPU kernel %s at level %s unavailable: %s", source.name, candidate, exc)
    log.error("CPU kernel %s builds at no level: using the torch path", source.name)
    return None


def _build_and_load(compiler: str, source: Path, level: str, cache_dir: Path | None):
    target = _target(compiler, source, level, cache_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build per library across processes
        if not target.exists():
            _compile(compiler, source, level, target)
        try:
            return ctypes.CDLL(str(target))
        except OSError as exc:  # a truncated or foreign file: build it again, once
            log.warning("cached kernel %s does not load (%s): rebuilding", target.name, exc)
            target.unlink(missing_ok=True)
            _compile(compiler, source, level, target)
            try:
                return ctypes.CDLL(str(target))
            except OSError as again:
                raise KernelBuildError(f"{target.name} does not load: {again}") from again


def _command(compiler: str, source: Path, level: str, output: Path) -> list[str]:
    rank = level_rank(level)
    flags = [*CFLAGS, *compiler_flags(level), f"-DYAIED_ISA_LEVEL={rank}"]
    return [compiler, *flags, f"-I{HERE}", str(source), "-o", str(output), "-lm"]


def _target(compiler: str, source: Path, level: str, cache_dir: Path | None) -> Path:
    """Once per source, headers, flags, compiler and CPU: later loads reuse the object."""
    digest = hashlib.sha256()
    for part in (source, *HEADERS):
        digest.update(part.read_bytes())
    digest.update(" ".join(_command(compiler, source, level, Path("out"))).encode())
    digest.update(_compiler_identity(compiler).encode())
    digest.update(platform.machine().encode())
    digest.update(" ".join(sorted(cpu_features())).encode() or platform.processor().encode())
    root = cache_dir or Path(os.environ.get("YAIED_CACHE_DIR", Path.home() / ".cache" / "yaied"))
    return root / "kernels" / f"{source.stem}-{level}-{digest.hexdigest()[:16]}.so"


def _compile(compiler: str, source: Path, level: str, target: Path) -> None:
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        try:
            subprocess.run(
                _command(compiler, source, level, built),
                check=True,
                capture_output=True,
                text=True,
                timeout=120,
            )
        except subprocess.CalledProcessError as exc:
            raise KernelBuildError(_compiler_message(exc.stderr or exc.stdout or "")) from exc
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise KernelBuildError(str(exc)) from exc
        os.replace(built, target)  # atomic: a concurrent reader never sees half a file


@cache
def _compiler_identity(compiler: str) -> str:
    """The compiler's path and version line: a new compiler builds anew."""
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
        return f"{os.path.realpath(compiler)} {done.stdout.splitlines()[0] if done.stdout else ''}"
    except (OSError, subprocess.TimeoutExpired):
        return compiler


def _compiler_message(text: str, limit: int = 4000) -> str:
    """The compiler's own words (its first errors come first), bounded for a log line."""
    text = text.strip()
    return (
        text[:limit] + " [...]" if len(text) > limit else text
    ) or "the compiler failed silently"
