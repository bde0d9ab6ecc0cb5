"""prepare_cpu_model: what the CPU's copies of the weights replaced goes back to the system."""

from __future__ import annotations

import platform
import shutil

import pytest

from tests.worker.heap import freed_but_resident_kb

# Prepares a model of the default model's shape (random weights) for this CPU in a fresh
# interpreter and keeps it (tests/worker/heap.py measures what it freed but left resident).
_PREPARED_HEAP = """
import sys
import torch
from yaied.core.config import EngineConfig, ModelConfig
from yaied.kernels.cpu_isa import selected_level
from yaied.worker.cpu_model import prepare_cpu_model
from yaied.worker.loader import load_model

config = EngineConfig(model=ModelConfig(model=sys.argv[1], load_format="dummy"))
level = selected_level()
loaded = load_model(config.model, torch.device("cpu"), show_progress=False, level=level)
kernels = prepare_cpu_model(loaded, config, level, config.scheduler.max_num_batched_tokens)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_the_replaced_weights_do_not_stay_resident(default_model_folder, tmp_path):
    """The weights that packed (or panel, or bf16-stored) copies replace are freed into the
    heap, where they stayed resident: 146 MB of the default model's 270 MB under bf16 packing,
    for the engine's whole life. Only the fp32 panel path handed them back."""
    config = tmp_path / "model.json"
    shutil.copy(default_model_folder / "config.json", config)
    assert freed_but_resident_kb(_PREPARED_HEAP, str(config)) < 8 * 1024  # kB
