from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def default_model_tokenizer(default_model_folder):
    """The embedded default model's tokenizer, whose ChatML template knows no tools."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_folder)
