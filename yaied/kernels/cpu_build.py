"""Compiling and loading the CPU kernels (yaied/kernels/*.c) with the system C compiler.

Each kernel is a self-contained C file (plus the shared headers cpu_*.h) built on first use
into the yaied cache folder and loaded with ctypes: no torch headers, so a build takes about a
second, and a machine without a compiler keeps the torch paths (``load_library`` returns None).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
HEADERS = [HERE / "cpu_common.h", HERE / "cpu_rows.h"]
# -fassociative-math lets the compiler vectorise the dot-product reductions; infinities stay
# legal (the online softmax starts from -inf), so no -ffast-math.
CFLAGS = [
    "-O3",
    "-march=native",
    "-shared",
    "-fPIC",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fno-signed-zeros",
    "-fassociative-math",
    "-fopenmp",
]


def load_library(source: Path, cache_dir: Path | None = None) -> ctypes.CDLL | None:
    """The compiled ``source``, or None where kernels are disabled or cannot be built."""
    if os.environ.get("YAIED_DISABLE_CPU_KERNELS"):
        return None
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        log.info("no C compiler found: %s is replaced by the torch path", source.name)
        return None
    try:
        return ctypes.CDLL(str(_build(compiler, source, cache_dir)))
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        log.warning("CPU kernel %s unavailable (%s): using the torch path", source.name, exc)
        return None


def _build(compiler: str, source: Path, cache_dir: Path | None) -> Path:
    """Compile once per source, header, flags and machine; later loads reuse the object."""
    text = source.read_bytes() + b"".join(h.read_bytes() for h in HEADERS)
    key = hashlib.sha256(
        text + " ".join(CFLAGS).encode() + platform.machine().encode() + _cpu_flags()
    ).hexdigest()[:16]
    root = cache_dir or Path(os.environ.get("YAIED_CACHE_DIR", Path.home() / ".cache" / "yaied"))
    target = root / "kernels" / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run(
            [compiler, *CFLAGS, f"-I{HERE}", str(source), "-o", str(built), "-lm"],
            check=True,
            capture_output=True,
            timeout=120,
        )
        os.replace(built, target)  # atomic: a concurrent build never leaves half a file
    return target


def _cpu_flags() -> bytes:
    # -march=native code must not be reused on a different CPU sharing the cache folder.
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.encode()
    except OSError:
        pass
    return platform.processor().encode()
