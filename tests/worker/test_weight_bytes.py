"""The start-time estimate of a CPU engine's weight bytes (yaied/worker/weight_bytes.py), read
from the files (safetensors headers, a GGUF table, a config's shapes) with no weights loaded:
against the rules it mirrors, and against what a load and the CPU preparation really keep."""

from __future__ import annotations

import json
import math
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.worker import gguf_files
from yaied.core.config import ModelConfig
from yaied.kernels.cpu_build import find_compiler, kernels_disabled
from yaied.kernels.cpu_isa import detected_level, runnable_levels
from yaied.kernels.cpu_quant import BY_GGML_ID
from yaied.worker import cpu_linear
from yaied.worker.loader import load_model
from yaied.worker.quantized import QuantizedLinear
from yaied.worker.weight_bytes import (
    FP32_COPY_MEMORY_SHARE,
    GEMV_MEMORY_SHARE,
    KEPT_GGML_IDS,
    WeightBytes,
    estimate_weight_bytes,
    weight_estimate,
)

T = gguf_files.T
GIB = 2**30
# No kernels and no memory to spare: only the copies every load keeps.
BARE = dict(kernels=False, memory=0)


def _counts(folder) -> tuple[int, int, int]:
    """(every weight, the decoder layers' 2-D weights, the LM head's) of a saved model."""
    tensors = {}
    for file in folder.glob("*.safetensors"):
        tensors.update(load_file(file))
    linear = sum(t.numel() for n, t in tensors.items() if t.dim() == 2 and "layers." in n)
    return sum(t.numel() for t in tensors.values()), linear, tensors["lm_head.weight"].numel()


def test_the_figures_it_mirrors_are_the_loaders():
    """This module loads no torch, so it repeats the kernels' block types and cpu_linear's
    shares of memory: they must stay the same."""
    assert set(BY_GGML_ID) == KEPT_GGML_IDS
    assert GEMV_MEMORY_SHARE == cpu_linear.GEMV_MEMORY_SHARE
    assert FP32_COPY_MEMORY_SHARE == cpu_linear.FP32_COPY_MEMORY_SHARE


def test_a_folders_weights_count_as_the_cpu_keeps_them(tiny_model_dirs):
    folder = tiny_model_dirs["llama"]  # untied
    total, linear, head = _counts(folder)
    model = ModelConfig(model=str(folder))
    bf16 = estimate_weight_bytes(model, level="avx512_bf16", **BARE)
    assert bf16 == WeightBytes(total * 2, total * 2)  # bf16 math: one copy without the kernel
    roomy = estimate_weight_bytes(model, level="avx512_bf16", kernels=True, memory=64 * GIB)
    assert roomy.expected > roomy.least == total * 2  # the few-row kernel's copy besides
    # fp32 math over bf16 linears (avx2): the embeddings and norms in fp32, linears in bf16,
    # and their fp32 copies where they fit
    avx2 = estimate_weight_bytes(model, level="avx2", **BARE)
    floats = linear + head
    assert avx2 == ((total - floats) * 4 + floats * 2,) * 2
    roomy = estimate_weight_bytes(model, level="avx2", kernels=True, memory=64 * GIB)
    assert roomy == (avx2.least, avx2.least + floats * 4)
    forced = ModelConfig(model=str(folder), dtype="float32")
    assert estimate_weight_bytes(forced, level="avx2", **BARE) == (total * 4, total * 4)


@pytest.mark.parametrize(("mode", "rate"), [("q8_0", 34 / 32), ("q4_0", 18 / 32)])
def test_packed_linears_and_head_count_as_their_blocks(tiny_model_dirs, mode, rate):
    folder = tiny_model_dirs["llama"]
    total, linear, head = _counts(folder)
    config = ModelConfig(model=str(folder), quantization=mode)
    estimate = estimate_weight_bytes(config, level="avx512_bf16", kernels=True, memory=64 * GIB)
    rest = total - linear - head
    expected = rest * 2 + linear * rate + head * 34 / 32  # the head in Q8_0 under both
    assert estimate.least == estimate.expected == pytest.approx(expected, abs=64)


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
    assert estimate_weight_bytes(dummy, level="avx512_bf16", **BARE).least == params * 2
    path.write_text(json.dumps({"hidden_size": 64}))  # not a shape it knows: no estimate
    assert estimate_weight_bytes(dummy, **BARE) is None


def test_a_broken_header_leaves_the_estimate_to_the_load(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes((2**60).to_bytes(8, "little"))
    assert estimate_weight_bytes(ModelConfig(model=str(tmp_path))) is None


def _loaded_bytes(model: torch.nn.Module) -> int:
    """The loaded model's weights: its parameters once each and its projections' blocks."""
    params = {id(p): p.nbytes for p in model.parameters()}
    blocks = sum(
        t.nbytes for m in model.modules() if isinstance(m, QuantizedLinear) for _, t in m.parts
    )
    return sum(params.values()) + blocks


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize(
    "kept",
    [T.Q8_0, T.Q3_K, T.Q2_K, T.IQ4_NL, T.IQ4_XS],
    ids=["q8_0", "q3_k", "q2_k", "iq4_nl", "iq4_xs"],
)
def test_a_gguf_counts_what_the_load_keeps_in_blocks(tmp_path, tied, kept):
    """A head in blocks (``output.weight``, or ``token_embd`` that a tied head is read from)
    counts as its blocks, a tied one's embeddings as nothing more; a fused projection with one
    part of a type without a kernel (Q5_0) stays float as a whole."""

    def kind(name: str) -> T:
        return T.Q5_0 if name == "blk.1.attn_v.weight" else kept

    shape = gguf_files.Shape(hidden=256, ffn=512, head_dim=64, vocab=96, tied=tied)
    path = gguf_files.write_gguf(tmp_path / "m.gguf", shape, kind)
    config = ModelConfig(
        model=str(path), quantization="auto", dtype="bfloat16", cache_dir=str(tmp_path / "cache")
    )
    loaded = load_model(config, torch.device("cpu"), show_progress=False)
    assert loaded.quantization == "gguf"
    assert not isinstance(loaded.model.layers[1].self_attn.qkv_proj, QuantizedLinear)
    estimate = estimate_weight_bytes(config, level="avx512_bf16", **BARE)
    assert estimate.least == _loaded_bytes(loaded.model)


def test_tensor_parallel_ranks_load_floats_whatever_the_quantization(tmp_path):
    shape = gguf_files.Shape(hidden=256, ffn=512, head_dim=64, vocab=96)
    path = gguf_files.write_gguf(tmp_path / "m.gguf", shape, gguf_files.every(T.Q4_0))
    config = ModelConfig(model=str(path), quantization="auto")
    one = estimate_weight_bytes(config, level="avx2", **BARE)
    two = estimate_weight_bytes(config, level="avx2", ranks=2, **BARE)
    as_none = ModelConfig(model=str(path), quantization="none")
    # fp32 math at avx2: every weight in fp32 over the ranks, not the file's blocks
    assert two.least > 5 * one.least
    assert two.least == estimate_weight_bytes(as_none, level="avx2", ranks=2, **BARE).least
    numel = estimate_weight_bytes(as_none, level="avx512_bf16", ranks=2, **BARE).least // 2
    assert two.least == numel * 4
    # what the start's check counts each engine with: the estimate at that engine's ranks
    by_ranks = weight_estimate(config)
    assert by_ranks(2) == estimate_weight_bytes(config, ranks=2) != by_ranks(1)
    assert by_ranks(1) == estimate_weight_bytes(config)


# Loads a dummy model and prepares it for this CPU (level by YAIED_CPU_ISA) in a fresh
# interpreter, once to warm torch up, then for each model: the growth of anonymous resident
# memory over load + prepare, and the estimate, as JSON lines.
_MEASURE = """
import ctypes, gc, json, sys
from pathlib import Path
import torch
from yaied.core.config import EngineConfig, ModelConfig
from yaied.kernels.cpu_isa import selected_level
from yaied.worker.cpu_model import prepare_cpu_model
from yaied.worker.loader import load_model
from yaied.worker.weight_bytes import estimate_weight_bytes

def anon():
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024

level = selected_level()
for model, quantization in json.loads(sys.argv[1]):
    model = ModelConfig(model=model, load_format="dummy", quantization=quantization)
    config = EngineConfig(model=model)
    before = anon()
    loaded = load_model(model, torch.device("cpu"), show_progress=False, level=level)
    prepare_cpu_model(loaded, config, level, config.scheduler.max_num_batched_tokens)
    grown = anon() - before
    del loaded
    print(json.dumps([model.model, quantization, grown, *estimate_weight_bytes(model)]))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
@pytest.mark.parametrize("level", sorted({detected_level(), "avx2"} & set(runnable_levels())))
def test_the_estimate_is_what_load_and_prepare_keep_resident(tmp_path, level):
    """Within 15% of the resident growth, at bf16 math (packed and few-row copies) and at avx2
    (bf16 linears, their fp32 copies, fp32 embeddings): untied, tied, and packed in blocks."""
    if find_compiler() is None or kernels_disabled():
        pytest.skip("the CPU kernels are not built here: the expected copies differ")
    models = {}
    for tied in (False, True):
        models[tied] = tmp_path / f"tied-{tied}.json"
        models[tied].write_text(json.dumps(dict(
            architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=512,
            num_hidden_layers=4, vocab_size=8192, intermediate_size=1536,
            num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=tied,
            max_position_embeddings=512)))  # fmt: skip
    runs = [(models[False], "none")] + [(models[t], "none") for t in (False, True)]
    runs.append((models[True], "q8_0"))
    result = subprocess.run(
        [sys.executable, "-c", _MEASURE, json.dumps([[str(m), q] for m, q in runs])],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
        env={**__import__("os").environ, "YAIED_CPU_ISA": level},
    )
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()[1:]]  # the warm-up apart
    assert len(lines) == 3
    for model, quantization, grown, least, expected in lines:
        what = f"{Path(model).name} {quantization} at {level}: {grown} resident"
        assert expected == pytest.approx(grown, rel=0.15), f"{what}, {expected} estimated"
        assert least <= grown * 1.02, f"{what}, {least} as the least"
    assert not math.isclose(lines[0][3], lines[0][4])  # copies beyond the least were counted
