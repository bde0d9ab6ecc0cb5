"""Shared fixtures: the embedded default model's tokenizer and one compiler for it."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from yaied.structured import GrammarCompiler
from yaied.structured.tokenizer import build_tokenizer_info


@pytest.fixture(scope="session")
def tokenizer(default_model_folder: Path) -> Any:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(default_model_folder)


@pytest.fixture(scope="session")
def vocab_size(default_model_folder: Path) -> int:
    """The model's logits width (config.json), which is what the bitmask must cover."""
    return json.loads((default_model_folder / "config.json").read_text())["vocab_size"]


@pytest.fixture(scope="session")
def tokenizer_info(tokenizer: Any, vocab_size: int) -> Any:
    return build_tokenizer_info(tokenizer, vocab_size)


@pytest.fixture(scope="session")
def compiler(tokenizer: Any, vocab_size: int, tokenizer_info: Any) -> Iterator[GrammarCompiler]:
    compiler = GrammarCompiler(tokenizer, vocab_size, tokenizer_info=tokenizer_info)
    yield compiler
    compiler.close()


@pytest.fixture
def make_compiler(
    tokenizer: Any, vocab_size: int, tokenizer_info: Any
) -> Iterator[Callable[..., GrammarCompiler]]:
    """A fresh compiler (own cache, counters and pool) sharing the session's tokenizer info."""
    made: list[GrammarCompiler] = []

    def make(**options: Any) -> GrammarCompiler:
        made.append(
            GrammarCompiler(tokenizer, vocab_size, tokenizer_info=tokenizer_info, **options)
        )
        return made[-1]

    yield make
    for compiler in made:
        compiler.close()


@pytest.fixture(scope="session")
def encode(tokenizer: Any) -> Callable[[str], list[int]]:
    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    return encode
