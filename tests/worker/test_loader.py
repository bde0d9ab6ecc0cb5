"""Model loading: dummy weights, dtypes, clear errors for what cannot run."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import TINY_CONFIGS, make_tiny_model
from yaied import LLM, SamplingParams


def test_dummy_model_from_a_config_file(tmp_path):
    path = tmp_path / "tiny-qwen3.json"
    path.write_text(json.dumps(TINY_CONFIGS["qwen3"]))
    with LLM(
        str(path), load_format="dummy", dtype="bfloat16", kv_cache_gib=0.01, show_progress=False
    ) as llm:
        assert llm.tokenizer is None and llm.model_folder is None
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
        assert len(out.token_ids) == 4 and out.text == ""
        with pytest.raises(ValueError, match="no tokenizer"):
            llm.generate(["text"])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_dtypes_run_and_agree_with_fp32_on_the_first_token(tiny_model_dirs, dtype):
    folder = str(tiny_model_dirs["llama"])
    prompt = [[5, 6, 7, 8, 9, 10]]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    with LLM(folder, dtype="float32", kv_cache_gib=0.01, show_progress=False) as llm:
        ref = llm.generate(prompt, params)[0].token_ids
    with LLM(folder, dtype=dtype, kv_cache_gib=0.01, show_progress=False) as llm:
        assert llm.engine.worker.loaded.dtype == getattr(torch, dtype)
        assert llm.generate(prompt, params)[0].token_ids == ref


def test_native_only_names_the_supported_architectures(tmp_path):
    path = tmp_path / "gpt2.json"
    path.write_text(
        json.dumps(
            {
                "model_type": "gpt2",
                "architectures": ["GPT2LMHeadModel"],
                "n_layer": 1,
                "n_embd": 32,
                "n_head": 2,
            }
        )
    )
    with pytest.raises(ValueError, match="GPT2LMHeadModel is not supported.*LlamaForCausalLM"):
        LLM(str(path), load_format="dummy", model_impl="native", show_progress=False)


def test_pool_too_small_for_one_context_is_refused(tiny_model_dirs):
    with pytest.raises(ValueError, match="KV pool holds"):
        LLM(str(tiny_model_dirs["llama"]), kv_cache_gib=1e-5, show_progress=False)


def test_a_pool_past_the_memory_left_is_refused_before_it_is_zeroed(tiny_model_dirs, monkeypatch):
    """Zeroing a pool larger than the machine's memory would end in the OOM killer."""
    from yaied.core import host_memory

    monkeypatch.setattr(host_memory, "available_bytes", lambda: 2**20)  # 1 MiB left
    with pytest.raises(ValueError, match="kv_cache_gib = 0.02: the KV pool would take more"):
        LLM(str(tiny_model_dirs["llama"]), kv_cache_gib=0.02)


def test_a_page_larger_than_the_whole_pool_is_refused_naming_the_page_size(tiny_model_dirs):
    """One page was always allocated, however large: a pool far past kv_cache_gib, or, past the
    memory left, an error that told the user to lower kv_cache_gib, which cannot help."""
    with pytest.raises(ValueError, match=r"cache\.page_size = 1048576: one KV page takes .* lower"):
        LLM(str(tiny_model_dirs["llama"]), kv_cache_gib=0.001, page_size=2**20)


def test_unknown_setting_and_bad_value_are_clear_errors(tiny_model_dirs):
    with pytest.raises(ValueError, match="unknown setting 'max_seqs'"):
        LLM(str(tiny_model_dirs["llama"]), max_seqs=4)
    with pytest.raises(ValueError, match="model.dtype"):
        LLM(str(tiny_model_dirs["llama"]), dtype="int8")


def test_unknown_model_name_is_a_clear_error():
    with pytest.raises(ValueError, match="not downloaded|hub"):
        LLM("meta-llama/Llama-3-8B", show_progress=False)


def test_a_bf16_model_is_built_in_bf16_with_the_values_of_an_fp32_load_cast_after(tmp_path):
    """Building in the final dtype (no fp32 copy while loading) must not change any weight."""
    from yaied.core.config import ModelConfig
    from yaied.worker.loader import _load_native, _resolve_config

    folder = make_tiny_model("qwen2", tmp_path / "qwen2")  # biases and tied weights too
    config = ModelConfig(model=str(folder))
    folder, hf_config = _resolve_config(config, show_progress=False)
    cpu = torch.device("cpu")
    direct = _load_native(config, folder, hf_config, cpu, torch.bfloat16, show_progress=False)
    via_fp32 = _load_native(config, folder, hf_config, cpu, torch.float32, False).to(torch.bfloat16)
    direct_params = dict(direct.named_parameters())
    for name, expected in via_fp32.named_parameters():
        assert direct_params[name].dtype == torch.bfloat16, name
        assert torch.equal(direct_params[name], expected), name
    assert direct.inv_freq.dtype == torch.float32


def test_build_model_allocates_in_the_requested_dtype():
    from transformers import AutoConfig

    from yaied.worker.models import build_model

    data = dict(TINY_CONFIGS["llama"])
    hf_config = AutoConfig.for_model(data.pop("model_type"), **data)
    model = build_model(hf_config, torch.device("cpu"), torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.inv_freq.dtype == torch.float32


def _imported_after(code: str, prefixes: tuple[str, ...]) -> list[str]:
    """The modules named by ``prefixes`` that ``code`` imported, in a fresh interpreter (pytest's
    may have them already)."""
    import subprocess
    import sys

    found = f"sorted(m for m in sys.modules if m.startswith({prefixes!r}))"
    code += f"\nimport json, sys; print(json.dumps({found}))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_serving_a_model_on_cpu_never_imports_the_compiler_stack(tmp_path):
    """torch._dynamo (and triton under it) cost a CPU daemon 0.6 s of start-up and about 100 MB
    resident; a meta-device Embedding's own init used to pull them in. On the CPU, since the
    CUDA path runs Triton."""
    path = tmp_path / "tiny-llama.json"
    path.write_text(json.dumps(TINY_CONFIGS["llama"]))
    code = (
        "from yaied import LLM, SamplingParams\n"
        f"llm = LLM({str(path)!r}, load_format='dummy', kv_cache_gib=0.01, show_progress=False,"
        " **{'device.device': 'cpu'})\n"
        "llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))"
    )
    assert _imported_after(code, ("torch._dynamo", "triton")) == []


def test_loading_a_native_model_imports_neither_sympy_nor_dtensor(tiny_model_dirs, tmp_path):
    """Materialising the meta-built model with torch.empty_like ran torch's Python reference,
    which imports sympy (about 30 MB resident, 0.2 s) on every native load. Qwen2 and Qwen3:
    transformers' own LlamaConfig module imports sympy and torch.distributed.tensor
    (utils.type_validators -> activations -> ... -> distributed.sharding_utils), which yaied
    cannot cut without leaving the library."""
    dummy = tmp_path / "tiny-qwen3.json"
    dummy.write_text(json.dumps(TINY_CONFIGS["qwen3"]))
    code = (
        "from yaied import LLM, SamplingParams\n"
        "params = SamplingParams(max_tokens=2, ignore_eos=True)\n"
        f"for model, extra in (({str(tiny_model_dirs['qwen2'])!r}, {{}}),"
        f" ({str(dummy)!r}, {{'load_format': 'dummy', 'dtype': 'bfloat16'}})):\n"
        "    with LLM(model, kv_cache_gib=0.01, show_progress=False, **extra) as llm:\n"
        "        assert len(llm.generate([[1, 2, 3]], params)[0].token_ids) == 2"
    )
    heavy = ("sympy", "torch.distributed.tensor", "torch._dynamo")
    assert _imported_after(code, heavy) == []


def test_materialize_allocates_each_tensor_on_the_device_as_to_empty_does():
    from torch import nn

    from yaied.worker.models import materialize

    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8, bias=True)).to(torch.bfloat16)
        model[1].weight = model[0].weight  # tied, as the lm head and embedding may be
        model[1].register_buffer("kept", torch.zeros(3), persistent=True)
        model[1].register_buffer("scratch", torch.zeros(2), persistent=False)
        model[1].bias.requires_grad_(False)
    materialize(model, torch.device("cpu"))
    tensors = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    assert {t.device.type for t in tensors.values()} == {"cpu"}
    assert {n: t.dtype for n, t in tensors.items()} == {
        "0.weight": torch.bfloat16,
        "1.weight": torch.bfloat16,
        "1.bias": torch.bfloat16,
        "1.kept": torch.float32,
        "1.scratch": torch.float32,
    }
    assert isinstance(model[1].weight, nn.Parameter) and model[1].weight.requires_grad
    assert not model[1].bias.requires_grad
    assert model[0].weight is not model[1].weight  # each its own, until tie_weights
    assert set(model.state_dict()) == {"0.weight", "1.weight", "1.bias", "1.kept"}


@pytest.mark.parametrize("bad_shape", [(32, 1), (64, 32)], ids=["broadcast", "transposed"])
def test_a_fused_projection_of_the_wrong_shape_names_the_weight(
    tiny_model_dirs, tmp_path, bad_shape
):
    """q/k/v and gate/up are copied into one fused weight: a part of the wrong shape was either
    broadcast into its rows without a word ([32, 1] fills a [32, 64] shard) or torch's bare
    'The size of tensor a ... must match'. Tensor names are the checkpoint's."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "bad"
    shutil.copytree(tiny_model_dirs["llama"], folder)
    weights = load_file(str(folder / "model.safetensors"))
    name = "model.layers.1.self_attn.k_proj.weight"
    assert tuple(weights[name].shape) == (32, 64)
    weights[name] = torch.randn(bad_shape)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{name}: shape \({bad_shape[0]}, {bad_shape[1]}\)"):
        LLM(str(folder), dtype="float32", kv_cache_gib=0.01, show_progress=False)
