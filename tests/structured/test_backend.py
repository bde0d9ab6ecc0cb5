"""xgrammar is imported on the first grammar, not with the modules that serve requests: a
process that serves no structured output does not hold it (and what it imports: transformers'
model loading, torch.distributed.tensor, sympy; about 45 MB resident and half a second)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

IMPORT_SERVING = """
import sys
import yaied.cli, yaied.daemon, yaied.llm, yaied.server.app
import yaied.engine.async_engine, yaied.engine.grammar, yaied.engine.step_loop
import yaied.worker.model_runner, yaied.worker.worker, yaied.structured
print("before", "xgrammar" in sys.modules)
from yaied.core.grammar_spec import make_spec
from yaied.structured import check_spec
check_spec(make_spec("regex", "[a-c]+", "p"))
print("after", "xgrammar" in sys.modules)
"""


def test_serving_modules_import_xgrammar_only_when_a_grammar_is_checked() -> None:
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_SERVING],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["before", "False", "after", "True"]
