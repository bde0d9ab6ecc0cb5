"""Structured outputs: constrain generation to a JSON schema, JSON, a regex, a choice or a grammar.

- `yaied.core.grammar_spec`: the request fields parsed into one canonical `GrammarSpec` (pure, no
  tokenizer; in core, since `SamplingParams` carries it through every layer), re-exported here;
- `compiler`: one `GrammarCompiler` per model (xgrammar), a byte-bounded cache, off-loop compiles;
  `check_spec`, whether a spec would compile, without the vocabulary;
- `matcher`: per-sequence grammar state and the persistent token bitmask applied to the logits.
"""

from yaied.core.grammar_spec import (
    MAX_SPEC_BYTES,
    GrammarSpec,
    StructuredOutputError,
    make_spec,
    parse_structured_output,
)
from yaied.structured.compiler import CompiledGrammar, CompileStats, GrammarCompiler, check_spec
from yaied.structured.matcher import (
    SequenceMatcher,
    TokenBitmask,
    allocate_bitmask,
    apply_bitmask,
    fill_bitmasks,
    row_allows_only,
)

__all__ = [
    "MAX_SPEC_BYTES",
    "CompileStats",
    "CompiledGrammar",
    "GrammarCompiler",
    "GrammarSpec",
    "SequenceMatcher",
    "StructuredOutputError",
    "TokenBitmask",
    "allocate_bitmask",
    "apply_bitmask",
    "check_spec",
    "fill_bitmasks",
    "make_spec",
    "parse_structured_output",
    "row_allows_only",
]
