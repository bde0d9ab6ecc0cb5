"""The router's front end: tokenizing and validating calls for engines that run elsewhere.

It reads the model's folder (tokenizer, generation defaults, EOS ids) and config, never its
weights; the limits (context length, vocabulary) come from what the engines reported.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from yaied.core.config import ModelConfig
from yaied.core.model_info import ModelInfo

if TYPE_CHECKING:
    from yaied.engine.inputs import InputProcessor


def front_inputs(model: ModelConfig, infos: list[ModelInfo]) -> InputProcessor:
    """An InputProcessor for ``model`` under the tightest limits any engine reported."""
    from yaied.engine.inputs import InputProcessor
    from yaied.worker.loader import resolve_model_config  # reads the config, not the weights

    folder, hf_config = resolve_model_config(model)
    vocab = min((i.vocab_size for i in infos if i.vocab_size), default=0)
    max_len = min((i.max_model_len for i in infos if i.max_model_len), default=0)
    info = ModelInfo(
        max_len or model.max_model_len or hf_config.max_position_embeddings,
        vocab or hf_config.vocab_size,
    )
    return InputProcessor(folder, hf_config, info)
