"""The start-time estimate of a CPU engine's weight bytes (yaied/worker/weight_bytes.py), read
from the files (safetensors headers, a config's shapes) with no weights loaded."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from yaied.core.config import ModelConfig
from yaied.worker.weight_bytes import estimate_weight_bytes


def _counts(folder) -> tuple[int, int]:
    """(every weight, the decoder layers' 2-D weights) of a saved model."""
    tensors = {}
    for file in folder.glob("*.safetensors"):
        tensors.update(load_file(file))
    linear = sum(t.numel() for n, t in tensors.items() if t.dim() == 2 and "layers." in n)
    return sum(t.numel() for t in tensors.values()), linear


def test_a_folders_weights_count_as_their_stored_dtype(tiny_model_dirs):
    folder = tiny_model_dirs["llama"]
    total, _ = _counts(folder)
    assert estimate_weight_bytes(ModelConfig(model=str(folder))) == total * 2  # bf16 under auto
    assert estimate_weight_bytes(ModelConfig(model=str(folder), dtype="float32")) == total * 4


@pytest.mark.parametrize(("mode", "rate"), [("q8_0", 34 / 32), ("q4_0", 18 / 32)])
def test_packed_linears_count_as_their_blocks(tiny_model_dirs, mode, rate):
    folder = tiny_model_dirs["llama"]
    total, linear = _counts(folder)
    estimate = estimate_weight_bytes(ModelConfig(model=str(folder), quantization=mode))
    assert estimate == pytest.approx((total - linear) * 2 + linear * rate, abs=64)
    assert 0 < linear < total


def test_a_dummy_models_weights_come_from_its_config(tmp_path):
    config = dict(
        hidden_size=64,
        num_hidden_layers=2,
        vocab_size=100,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    per_layer = 64 * 64 * 2 + 2 * 64 * 32 + 3 * 64 * 128  # q, o; k, v (2 heads of 16); mlp
    params = 2 * 100 * 64 + 2 * per_layer  # embeddings and an untied head
    dummy = ModelConfig(model=str(path), load_format="dummy")
    assert estimate_weight_bytes(dummy) == params * 2
    path.write_text(json.dumps({"hidden_size": 64}))  # not a shape it knows: no estimate
    assert estimate_weight_bytes(dummy) is None


def test_a_broken_header_leaves_the_estimate_to_the_load(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes((2**60).to_bytes(8, "little"))
    assert estimate_weight_bytes(ModelConfig(model=str(tmp_path))) is None
