"""The router's front end: tokenizing and validating calls for engines that run elsewhere.

It reads the model's folder (tokenizer, generation defaults, EOS ids) and config, never its
weights; the limits (context length, vocabulary) come from what the engines reported, and the
context length then follows the pool (limits.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from yaied.core.config import ModelConfig
from yaied.core.model_info import ModelInfo

if TYPE_CHECKING:
    from yaied.engine.inputs import InputProcessor


def front_inputs(model: ModelConfig, infos: list[ModelInfo]) -> InputProcessor:
    """An InputProcessor for ``model`` under the tightest limits any engine reported."""
    from yaied.engine.inputs import inputs_for_model  # deferred: the engine layer loads torch

    return inputs_for_model(model, infos)
