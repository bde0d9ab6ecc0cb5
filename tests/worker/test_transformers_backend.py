"""transformers' own model classes on yaied's paged KV cache (model_impl = "transformers"):
greedy output equals transformers' generate, alone, in mixed batches and over prefix-cache hits,
for architectures without a native implementation; what cannot run is a clear error."""

from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import assert_greedy_equal, hf_greedy, make_tiny_model
from yaied import LLM, SamplingParams
from yaied.core.step import ScheduledSeq
from yaied.worker.models.transformers_backend import TransformersModel

NEW_TOKENS = 16
PARAMS = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
WINDOW = 24  # shorter than most test prompts, so sliding-window layers really drop keys

_SHAPE = dict(vocab_size=256, tie_word_embeddings=False)
_HEADS = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)
# Architectures without a native implementation; each entry says what makes it different.
HF_TINY_CONFIGS: dict[str, dict] = {
    # absolute learned positions, Conv1D projections, fused qkv, layer norm with bias
    "gpt2": dict(
        **_SHAPE,
        model_type="gpt2",
        architectures=["GPT2LMHeadModel"],
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=1024,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # learned positions offset by 2, q scaled before attention (scaling=1.0 at the call)
    "opt": dict(
        **_SHAPE,
        model_type="opt",
        architectures=["OPTForCausalLM"],
        hidden_size=64,
        ffn_dim=128,
        word_embed_proj_dim=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=1024,
    ),
    # embeddings scaled by sqrt(hidden), (1 + w) RMSNorm, gelu, multi-query attention
    "gemma": dict(
        _SHAPE | _HEADS,
        model_type="gemma",
        architectures=["GemmaForCausalLM"],
        head_dim=16,
        num_key_value_heads=1,
    ),
    # fused qkv and gate_up projections, partial rotary
    "phi3": dict(
        **_SHAPE,
        **_HEADS,
        model_type="phi3",
        architectures=["Phi3ForCausalLM"],
        partial_rotary_factor=0.5,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # a sliding window shorter than the prompts
    "mistral-sliding": dict(
        **_SHAPE,
        **_HEADS,
        model_type="mistral",
        architectures=["MistralForCausalLM"],
        sliding_window=WINDOW,
    ),
    # alternating sliding/full layers, attention and final logit softcapping, its own q scale
    "gemma2": dict(
        **_SHAPE,
        **_HEADS,
        model_type="gemma2",
        architectures=["Gemma2ForCausalLM"],
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=WINDOW,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0,
    ),
    # logits multiplied by logit_scale after lm_head (invisible to greedy, not to logprobs)
    "cohere": dict(
        **_SHAPE,
        **_HEADS,
        model_type="cohere",
        architectures=["CohereForCausalLM"],
        logit_scale=0.5,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # embedding, residual and attention multipliers; logits divided by logits_scaling
    "granite": dict(
        **_SHAPE,
        **_HEADS,
        model_type="granite",
        architectures=["GraniteForCausalLM"],
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
        attention_multiplier=0.1,
        logits_scaling=4.0,
    ),
    # a router that subclasses nn.Linear with a forward of its own (returns three tensors)
    "phimoe": dict(
        **_SHAPE,
        **_HEADS,
        model_type="phimoe",
        architectures=["PhimoeForCausalLM"],
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=None,
    ),
    # partial rotary, parallel attention and MLP residual
    "gpt_neox": dict(
        **_SHAPE,
        model_type="gpt_neox",
        architectures=["GPTNeoXForCausalLM"],
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=1024,
        rotary_pct=0.5,
    ),
}


def random_prompts(rng: random.Random, count: int, low: int, high: int) -> list[list[int]]:
    return [[rng.randrange(256) for _ in range(rng.randint(low, high))] for _ in range(count)]


def mixed_prompts(seed: int) -> list[list[int]]:
    """Two groups sharing a 40..60-token prefix (prefix hits once cached), and loose prompts."""
    rng = random.Random(seed)
    prompts = random_prompts(rng, 4, 3, 100)
    for _ in range(2):
        prefix = random_prompts(rng, 1, 40, 60)[0]
        prompts += [prefix + p for p in random_prompts(rng, 3, 1, 20)]
    return prompts


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-tiny")
    return {
        kind: make_tiny_model(kind, root / kind, configs=HF_TINY_CONFIGS)
        for kind in HF_TINY_CONFIGS
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", list(HF_TINY_CONFIGS))
def test_greedy_matches_transformers_with_prefix_hits(hf_dirs, kind, monkeypatch):
    # The fused CPU decode kernel serves most runs; two take the torch decode buckets instead.
    monkeypatch.setenv("YAIED_DISABLE_CPU_KERNELS", "1" if kind in ("gemma2", "opt") else "")
    folder = hf_dirs[kind]
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = mixed_prompts(seed=len(kind))
    with LLM(
        str(folder),
        dtype="float32",
        model_impl="transformers",
        kv_cache_gib=0.01,
        max_num_batched_tokens=48,  # chunked prefill, chunks over cached context, mixed steps
        show_progress=False,
    ) as llm:
        assert isinstance(llm.engine.worker.runner.model, TransformersModel)
        first = llm.generate(prompts, PARAMS)
        again = llm.generate(prompts[::-1], PARAMS)[::-1]  # now mostly prefix-cache hits
        alone = llm.generate([prompts[0]], PARAMS)[0]
        check_prefill_logits(llm, reference, prompts[-1])
        stats = llm.stats()
    assert stats["num_free_pages"] == stats["num_pages"]
    assert all(out.num_cached_tokens > 0 for out in again[4:])
    assert [o.token_ids for o in again] == [o.token_ids for o in first]
    assert alone.token_ids == first[0].token_ids
    for prompt, out in zip(prompts, first, strict=True):
        assert out.finish_reason == "length"
        ref = hf_greedy(reference, prompt, NEW_TOKENS)
        assert_greedy_equal(reference, prompt, out.token_ids, ref)


def check_prefill_logits(llm: LLM, reference, prompt: list[int]) -> None:
    """Last-position logits of one prefill equal transformers' to fp32 rounding: scalings after
    lm_head do not change greedy tokens, but they do change sampling and logprobs."""
    runner = llm.engine.worker.runner
    pages = llm.engine.pool.allocate(llm.engine.pool.pages_for(len(prompt)))
    try:
        seq = ScheduledSeq("x", prompt, 0, pages, True, SamplingParams(temperature=0.0))
        prepared = runner.packer.build([seq])
        with torch.inference_mode():
            hidden = runner.model(
                prepared.input_ids, prepared.positions, runner.kv_caches, prepared.meta
            )
            ours = runner.model.compute_logits(hidden[prepared.sample_rows])[0]
            theirs = reference(torch.tensor([prompt])).logits[0, -1]
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    finally:
        llm.engine.pool.free(pages)


def test_the_sliding_window_changes_the_output(hf_dirs):
    """Guards the test above: with the window ignored, the tokens differ from the reference."""
    folder = hf_dirs["mistral-sliding"]
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompt = random_prompts(random.Random(4), 1, 90, 90)[0]
    windowed = hf_greedy(reference, prompt, NEW_TOKENS)
    reference.config.sliding_window = None
    reference.model.config.sliding_window = None
    assert hf_greedy(reference, prompt, NEW_TOKENS) != windowed


@pytest.mark.slow  # loads the default model twice
@pytest.mark.timeout(120)
def test_default_model_same_tokens_as_native():
    prompt = "The three primary colours are"
    outputs = {}
    for impl in ("native", "transformers"):
        with LLM(
            "smollm2-135m-instruct", dtype="float32", model_impl=impl, show_progress=False
        ) as llm:
            kind = type(llm.engine.worker.runner.model).__name__
            outputs[impl] = llm.generate([prompt], PARAMS)[0].token_ids
        assert (kind == "TransformersModel") == (impl == "transformers")
    assert outputs["native"] == outputs["transformers"]


@pytest.mark.parametrize(
    ("kind", "impl", "expected"),
    [("llama", "auto", "LlamaForCausalLM"), ("gpt2", "auto", "TransformersModel")],
)
def test_auto_prefers_native(tmp_path, kind, impl, expected):
    values = dict(HF_TINY_CONFIGS["gpt2"]) if kind == "gpt2" else _llama_config()
    path = tmp_path / f"{kind}.json"
    path.write_text(json.dumps(values))
    with LLM(
        str(path), load_format="dummy", model_impl=impl, kv_cache_gib=0.01, show_progress=False
    ) as llm:
        assert type(llm.engine.worker.runner.model).__name__ == expected
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
        assert len(out.token_ids) == 3


def _llama_config() -> dict:
    return dict(**_SHAPE, **_HEADS, model_type="llama", architectures=["LlamaForCausalLM"])


def _dummy(tmp_path, values: dict, **overrides) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(values))
    LLM(str(path), load_format="dummy", kv_cache_gib=0.01, show_progress=False, **overrides)


def test_native_only_names_the_way_out(tmp_path):
    with pytest.raises(ValueError, match="GPT2LMHeadModel is not supported.*model_impl"):
        _dummy(tmp_path, HF_TINY_CONFIGS["gpt2"], model_impl="native")


def test_encoder_decoder_is_refused(tmp_path):
    t5 = dict(model_type="t5", architectures=["T5ForConditionalGeneration"], vocab_size=64)
    t5.update(d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16)
    with pytest.raises(ValueError, match=r"config\.json \(T5ForConditionalGeneration\) is an enc"):
        _dummy(tmp_path, t5, model_impl="transformers")


def test_class_without_attention_interface_is_refused(tmp_path):
    bloom = dict(model_type="bloom", architectures=["BloomForCausalLM"], vocab_size=64)
    bloom.update(hidden_size=32, n_layer=1, n_head=2)
    with pytest.raises(ValueError, match="config.json: BloomForCausalLM does not support .*atten"):
        _dummy(tmp_path, bloom, model_impl="auto")


def test_layers_that_bypass_the_attention_interface_are_refused():
    """The load-time probe: a model whose layers attend some other way (here transformers' own
    SDPA) never reaches the paged cache, so it is refused rather than served wrong."""
    from transformers import AutoConfig

    values = _llama_config()
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    with pytest.raises(ValueError, match="model tiny: LlamaForCausalLM: 0 of 2 layers attend"):
        TransformersModel(model, "tiny")


_REFUSED_BY_THE_PROBE = {
    # the decoder layer drops its kwargs before the attention call
    "nemotron": (dict(model_type="nemotron"), "do not pass their keyword arguments on"),
    # differential attention: two calls per layer, each with half of V
    "diffllama": (dict(model_type="diffllama"), "layer 0 attends twice per step"),
    # multi-head latent attention: V's head size differs from K's
    "deepseek_v3": (
        dict(
            model_type="deepseek_v3",
            num_key_value_heads=4,
            kv_lora_rank=32,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_group=1,
            topk_group=1,
        ),
        "values have head size 16, keys 24",
    ),
    # a prediction head between the base model and the output embeddings
    "modernbert-decoder": (
        dict(model_type="modernbert-decoder", bos_token_id=1, eos_token_id=2, sep_token_id=3),
        "logits are not its output embeddings'",
    ),
    # attention sinks: an extra logit per head in the softmax
    "gpt_oss": (
        dict(model_type="gpt_oss", head_dim=16, num_local_experts=4, num_experts_per_tok=2),
        r"sink logits \(s_aux\)",
    ),
}


@pytest.mark.parametrize("kind", list(_REFUSED_BY_THE_PROBE))
def test_attention_the_pages_cannot_serve_is_refused(tmp_path, kind):
    """Served as if plain, these gave wrong tokens or crashed; the load-time probe refuses them
    with one line that names the model and what its attention needs."""
    values, reason = _REFUSED_BY_THE_PROBE[kind]
    values = _SHAPE | _HEADS | dict(pad_token_id=0) | values
    with pytest.raises(ValueError, match=f"config.json: .*ForCausalLM: .*{reason}") as info:
        _dummy(tmp_path, values, model_impl="transformers")
    assert "\n" not in str(info.value)


def test_chunked_attention_is_refused(tmp_path):
    """Llama 4's text layers attend within chunks of attention_chunk_size, which the paged
    attention does not apply: refused by name, not served wrong (nor "has no base model")."""
    values = _SHAPE | _HEADS | dict(model_type="llama4_text", attention_chunk_size=32)
    with pytest.raises(ValueError, match=r"config.json \(.*\): its attention is chunked") as info:
        _dummy(tmp_path, values, model_impl="transformers")
    assert "\n" not in str(info.value)


def test_batch_dependent_rope_is_refused_past_its_original_length(tmp_path):
    phi3 = dict(HF_TINY_CONFIGS["phi3"], partial_rotary_factor=1.0, max_position_embeddings=512)
    phi3["rope_scaling"] = dict(rope_type="longrope", short_factor=[1.0] * 8, long_factor=[2.0] * 8)
    phi3["original_max_position_embeddings"] = 128
    with pytest.raises(ValueError, match="longrope.*max_model_len <= 128"):
        _dummy(tmp_path, phi3, model_impl="transformers")
    _dummy(tmp_path, phi3, model_impl="transformers", max_model_len=128)  # never rescaled


_CUSTOM_CONFIG = """from transformers import LlamaConfig


class CustomConfig(LlamaConfig):
    model_type = "yaied-custom-llama"
"""
_CUSTOM_MODEL = """from transformers import LlamaForCausalLM

from .configuration_custom import CustomConfig


class CustomForCausalLM(LlamaForCausalLM):
    config_class = CustomConfig
"""


def test_remote_code_is_refused_while_off_and_runs_when_trusted(tmp_path):
    values = _llama_config()
    values.update(model_type="yaied-custom-llama", architectures=["CustomForCausalLM"])
    values["auto_map"] = {
        "AutoConfig": "configuration_custom.CustomConfig",
        "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM",
    }
    (tmp_path / "config.json").write_text(json.dumps(values))
    (tmp_path / "configuration_custom.py").write_text(_CUSTOM_CONFIG)
    (tmp_path / "modeling_custom.py").write_text(_CUSTOM_MODEL)
    settings = dict(load_format="dummy", kv_cache_gib=0.01, show_progress=False)
    for impl in ("native", "transformers", "auto"):
        with pytest.raises(ValueError, match=f"model {tmp_path}: .*trust_remote_code = true"):
            LLM(str(tmp_path), model_impl=impl, **settings)
    with pytest.raises(ValueError, match="trust_remote_code is not supported by native"):
        LLM(str(tmp_path), model_impl="native", trust_remote_code=True, **settings)
    with LLM(str(tmp_path), model_impl="auto", trust_remote_code=True, **settings) as llm:
        assert type(llm.engine.worker.runner.model.hf_model).__name__ == "CustomForCausalLM"
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
        assert len(out.token_ids) == 3
