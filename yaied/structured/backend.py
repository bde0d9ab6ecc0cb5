"""xgrammar, imported on first use.

Importing xgrammar imports transformers' model-loading code, torch.distributed.tensor and sympy
with it: about 45 MB resident and half a second, which a process that never serves a structured
output should not pay. The first constrained request pays the import along with the tokenizer
scan it needs anyway (engine/grammar.py builds the compiler then); nothing in yaied imports
xgrammar at module level (tests/structured/test_backend.py checks it in a fresh interpreter).
"""

from __future__ import annotations

from types import ModuleType


def xgrammar() -> ModuleType:
    """The xgrammar module (imported on the first call, then sys.modules' lookup)."""
    import xgrammar as xgr  # deferred: see the module's docstring

    return xgr
