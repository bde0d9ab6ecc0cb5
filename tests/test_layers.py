"""The layers hold: the import-linter contracts of pyproject.toml ([tool.importlinter]) are kept,
and importing the HTTP server loads no torch (the engine loads it later, in the server's lifespan).

scripts/test runs `lint-imports` itself before pytest; the test here puts the same check into the
fast loop (plain `pytest`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str) -> subprocess.CompletedProcess:
    # In the repository root, so that the yaied analysed and imported is this checkout's.
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )


def test_import_contracts_are_kept():
    result = run_python(
        "import sys; from importlinter.cli import lint_imports; "
        "sys.exit(lint_imports(no_cache=True, no_logo=True))"
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_importing_the_server_leaves_torch_unimported():
    result = run_python(
        "import sys, yaied.server.app\n"
        "loaded = sorted(name for name in sys.modules if name.startswith('yaied.'))\n"
        "assert 'torch' not in sys.modules, loaded\n"
    )
    assert result.returncode == 0, result.stderr


def test_importing_the_request_types_leaves_torch_unimported():
    # `import yaied` for SamplingParams and friends: the facade loads the engine lazily.
    result = run_python(
        "import sys, yaied, yaied.core.request, yaied.core.config\n"
        "assert 'torch' not in sys.modules\n"
    )
    assert result.returncode == 0, result.stderr
