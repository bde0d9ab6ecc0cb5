"""Shared fixtures: tiny random-weight models saved as Hugging Face folders, and greedy oracles."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.cpu_levels import LEVELS

# Triton kernels run in Triton's interpreter where CUDA is absent. Triton reads the variable when
# a kernel module is imported (@triton.jit), so it is set here, before any test imports one;
# nothing else on a CPU box uses Triton, so it is harmless for every other test.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(params=LEVELS)
def isa_level(request) -> str:
    """Each ISA level this CPU runs (tests/cpu_levels.py)."""
    return request.param


# The files that take longest (seconds in a two-worker run of scripts/test, 2026-11-27), in that
# order. pytest-xdist hands files out in collection order (`--dist loadfile`), so one of these
# left for last would run alone on one worker at the end; they go first instead.
_LONGEST_FILES = (
    "tests/worker/test_quantized_accuracy.py",  # 88
    "tests/router/test_ray_engines.py",  # 75
    "tests/engine/test_structured.py",  # 58
    "tests/engine/test_engine_fuzz.py",  # 54
    "tests/test_shutdown.py",  # 47
    "tests/test_bench_offline.py",  # 46
    "tests/worker/test_default_model_parity.py",  # 45
    "tests/test_soak.py",  # 41
    "tests/test_daemon.py",  # 39
    "tests/clients/test_lm_eval.py",  # 35
)


def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked `cuda` need a CUDA device and compiled kernels. Every test gets an id of its
    own (see _give_shared_ids_their_names), and under xdist the longest files come first."""
    _give_shared_ids_their_names(items)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        rank = {name: i for i, name in enumerate(_LONGEST_FILES)}
        items.sort(key=lambda item: rank.get(item.nodeid.partition("::")[0], len(rank)))
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return
    reason = "needs CUDA with TRITON_INTERPRET unset"
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


def _give_shared_ids_their_names(items) -> None:
    """schemathesis's per-operation tests (tests/server/test_schemathesis.py) carry the operation
    in their name, but under pytest 9.2 they all get the bare function's node id. pytest-xdist
    (scripts/test) schedules by node id and would run one operation of the twenty; such items
    get an id from their name instead."""
    counts = Counter(item.nodeid for item in items)
    for item in items:
        if counts[item.nodeid] > 1 and item.name != item.nodeid.rpartition("::")[2]:
            item._id = item.parent.id.child(item.name)


# Shapes shared by every tiny config; each entry below says what makes its family different.
_TINY_BASE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    rope_theta=10000.0,
)
TINY_CONFIGS: dict[str, dict] = {
    "llama": dict(_TINY_BASE, model_type="llama", architectures=["LlamaForCausalLM"]),
    "llama3-scaled": dict(
        _TINY_BASE,
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        num_key_value_heads=1,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=128,
        ),
    ),
    "mistral": dict(
        _TINY_BASE,
        model_type="mistral",
        architectures=["MistralForCausalLM"],
        sliding_window=None,
    ),
    "qwen2": dict(
        _TINY_BASE,
        model_type="qwen2",
        architectures=["Qwen2ForCausalLM"],
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
    ),
    "qwen3": dict(
        _TINY_BASE,
        model_type="qwen3",
        architectures=["Qwen3ForCausalLM"],
        head_dim=32,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
    ),
}


def make_tiny_model(
    kind: str, folder: Path, std: float = 0.3, seed: int = 0, configs: dict | None = None
) -> Path:
    """Save a random-weight model (of ``configs``, by default TINY_CONFIGS). A large init std makes
    logits spread out, so greedy choices are rarely near-ties and a mismatch means a real bug."""
    from transformers import AutoConfig, AutoModelForCausalLM

    values = dict((configs or TINY_CONFIGS)[kind])
    config = AutoConfig.for_model(values.pop("model_type"), **values, initializer_range=std)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)  # not all ones: exercise the weights
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def default_model_folder() -> Path:
    """The embedded default model's converted folder, from the real cache: the first run
    converts it, every later run and test file reuses it."""
    from yaied.worker.model_files import DEFAULT_MODEL_NAME, resolve_model_folder

    return resolve_model_folder(DEFAULT_MODEL_NAME, show_progress=False)


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {kind: make_tiny_model(kind, root / kind) for kind in TINY_CONFIGS}


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Reference greedy continuation of one prompt with transformers' generate (no padding).
    EOS is neither a stop nor suppressed, as with ignore_eos: min_new_tokens would ban it."""
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    ids = torch.tensor([prompt])
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None  # else generate merges the model's EOS back in
    try:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    finally:
        model.generation_config.eos_token_id = saved
    assert out.shape[1] == len(prompt) + max_new_tokens
    return out[0, len(prompt) :].tolist()


def assert_greedy_equal(model, prompt: list[int], ours: list[int], ref: list[int]) -> None:
    """Token-identical, except after a near-tie in the reference (top-2 logit gap under 1e-4),
    where our choice must be one of the tied tokens and the run stops being comparable."""
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        if a == b:
            continue
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ref[:i]])).logits[0, -1].float()
        top2 = logits.topk(2).values
        gap = float(top2[0] - top2[1])
        assert gap < 1e-4, f"token {i}: ours {a} != reference {b}, top-2 gap {gap:.2e}"
        assert abs(float(logits[a] - logits[b])) < 1e-4
        return
