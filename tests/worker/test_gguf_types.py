"""GGUF files as llama.cpp users have them, under ``--quantization gguf``: every type yaied has a
kernel for (kept in blocks) and those it has none for (dequantized, with one log line), mixed
per tensor as llama.cpp's quantize writes them (Q4_K_M), on llama-, qwen2- (biases) and qwen3-
shaped (Q/K norms) models, tied and untied, GQA and not. Each must give the greedy tokens of the
same file dequantized (``--quantization none``) in fp32: the blocks hold the same values, and
only the order of the sums differs."""

from __future__ import annotations

import logging
import random

import pytest

from tests.worker.gguf_files import (
    Shape,
    T,
    every,
    iq4_xs,
    q2_k,
    q3_k_m,
    q4_k_m,
    q5_k_m,
    write_gguf,
)
from yaied import LLM, SamplingParams
from yaied.worker.quantized import QuantizedLinear

K_SHAPE = dict(hidden=256, ffn=512, head_dim=64)  # rows of whole Q4_K super-blocks
# name: (shape, types, the block types served, whether one log line names dequantized tensors)
CASES = {
    "q8_0": (Shape(), every(T.Q8_0), "q8_0", False),
    "q4_0": (Shape(), every(T.Q4_0), "q4_0", False),
    "q4_1-tied-mha": (Shape(tied=True, kv_heads=4), every(T.Q4_1), "q4_1", False),
    "q4_k": (Shape(**K_SHAPE), every(T.Q4_K), "q4_k", False),
    # layer 0's q/k/v mix Q4_K and Q6_K: that merged projection is stacked from the two
    "q4_k_m": (Shape(**K_SHAPE), q4_k_m, "q4_k+q6_k", False),
    "q4_k_m-tied": (Shape(**K_SHAPE, tied=True), q4_k_m, "q4_k+q6_k", False),
    "q5_0": (Shape(), every(T.Q5_0), "", True),
    "q5_1": (Shape(), every(T.Q5_1), "", True),
    "q5_k": (Shape(**K_SHAPE), every(T.Q5_K), "q5_k", False),
    "q5_k_m": (Shape(**K_SHAPE), q5_k_m, "q5_k+q6_k", False),
    "q6_k": (Shape(**K_SHAPE), every(T.Q6_K), "q6_k", False),
    "q3_k": (Shape(**K_SHAPE), every(T.Q3_K), "q3_k", False),
    # q and k in Q3_K, V in Q5_K (layer 0) or Q4_K: each merged q/k/v is stacked from two types
    "q3_k_m": (Shape(**K_SHAPE), q3_k_m, "q3_k+q4_k+q5_k+q6_k", False),
    "q3_k_m-tied": (Shape(**K_SHAPE, tied=True), q3_k_m, "q3_k+q4_k+q5_k", False),
    "q2_k": (Shape(**K_SHAPE), every(T.Q2_K), "q2_k", False),
    "q2_k-mix": (Shape(**K_SHAPE), q2_k, "q2_k+q3_k+q4_k+q6_k", False),
    "iq4_nl": (Shape(), every(T.IQ4_NL), "iq4_nl", False),
    "iq4_nl-tied-mha": (Shape(tied=True, kv_heads=4), every(T.IQ4_NL), "iq4_nl", False),
    "iq4_xs": (Shape(**K_SHAPE), every(T.IQ4_XS), "iq4_xs", False),
    "iq4_xs-mix": (Shape(**K_SHAPE), iq4_xs, "iq4_nl+iq4_xs+q6_k", False),
    "iq4_xs-tied": (Shape(**K_SHAPE, tied=True), iq4_xs, "iq4_nl+iq4_xs", False),
    "f16": (Shape(), every(T.F16), "", True),
    "bf16": (Shape(), every(T.BF16), "", True),
    "qwen2-q4_0-tied": (Shape(arch="qwen2", tied=True), every(T.Q4_0), "q4_0", False),
    "qwen3-q8_0": (Shape(arch="qwen3", head_dim=32), every(T.Q8_0), "q8_0", False),
    "qwen3-q4_k": (Shape(arch="qwen3", **K_SHAPE), every(T.Q4_K), "q4_k", False),
}


def _greedy(path, quantization: str, cache) -> tuple[list[list[int]], str]:
    rng = random.Random(1)
    prompts = [[rng.randrange(64) for _ in range(rng.randint(3, 40))] for _ in range(6)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    llm = LLM(str(path), quantization=quantization, dtype="float32", kv_cache_gib=0.02,
              show_progress=False, cache_dir=str(cache))  # fmt: skip
    try:
        tokens = [o.token_ids for o in llm.generate(prompts, params)]
        return tokens, llm.engine.worker.info.quantization
    finally:
        llm.close()


@pytest.mark.parametrize("case", list(CASES))
def test_each_type_gives_the_dequantized_models_tokens(case, tmp_path, caplog):
    shape, types, served, logged = CASES[case]
    path = write_gguf(tmp_path / f"{case}.gguf", shape, types)
    with caplog.at_level(logging.WARNING, logger="yaied.worker.quantized"):
        ours, kinds = _greedy(path, "gguf", tmp_path)
    lines = [r for r in caplog.records if "without a quantized kernel" in r.getMessage()]
    assert len(lines) == (1 if logged else 0), [r.getMessage() for r in lines]
    assert kinds == served
    theirs, _ = _greedy(path, "none", tmp_path)
    assert ours == theirs


def test_engine_features_over_a_q4_k_m_files_blocks(tmp_path):
    """A Q4_K_M file's blocks (Q4_K, and Q6_K for the head, layer 0's down projection and its V,
    which is stacked under its Q and K: every projection kept, so the decode loop runs) under
    prefix hits, preemption (a pool of 20
    pages for 8 requests of up to 8) and speculative decoding, in fp32: the greedy tokens of the
    dequantized file without any of them, every page back; logprobs and prompt logprobs those of
    the dequantized file up to the order of sums; a seeded sample the same whatever the batch."""
    path = write_gguf(tmp_path / "m.gguf", Shape(**K_SHAPE), q4_k_m)
    rng = random.Random(3)
    shared = [rng.randrange(64) for _ in range(40)]
    prompts = [shared + [rng.randrange(64) for _ in range(rng.randint(3, 60))] for _ in range(8)]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3)
    # prompt logprobs score every prompt position: those requests skip the prefix cache
    scored = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2)
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)
    base = dict(dtype="float32", max_num_batched_tokens=64, show_progress=False,
                cache_dir=str(tmp_path))  # fmt: skip
    plain = LLM(str(path), quantization="none", enable_prefix_caching=False, kv_cache_gib=0.02,
                **base)  # fmt: skip
    try:
        expected = plain.generate(prompts, greedy)
        expected_scores = plain.generate(prompts, scored)
    finally:
        plain.close()
    # 2 layers x 2 KV heads x 64 x fp32, K and V: 2 KiB a token, 320 tokens
    llm = LLM(str(path), quantization="gguf", kv_cache_gib=320 * 2048 / 2**30, max_model_len=256,
              max_num_seqs=8, speculative_method="ngram", **base)  # fmt: skip
    try:
        model = llm.engine.worker.runner.model
        kept = {n: m.extra_repr().split(", ")[-1] for n, m in model.named_modules()
                if isinstance(m, QuantizedLinear)}  # fmt: skip
        assert len(kept) == 2 * 4 + 1 and kept["lm_head"] == "q6_k"
        assert kept["layers.0.self_attn.qkv_proj"] == "q4_k+q6_k"
        assert kept["layers.0.mlp.down_proj"] == "q6_k" and kept["layers.1.mlp.down_proj"] == "q4_k"
        assert model.decode_loop is not None  # every projection on the kernel
        assert llm.engine.worker.info.quantization == "q4_k+q6_k"
        outputs = llm.generate(prompts, greedy)
        stats = llm.stats()
        scores = llm.generate(prompts, scored)
        forward = llm.generate(prompts, seeded)
        backward = llm.generate(prompts[::-1], seeded)[::-1]
    finally:
        llm.close()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert stats["num_free_pages"] == stats["num_pages"]
    assert [o.token_ids for o in outputs] == [e.token_ids for e in expected]
    for ours, theirs in zip(outputs, expected, strict=True):
        for a, b in zip(ours.logprobs, theirs.logprobs, strict=True):
            assert a.top_ids == b.top_ids
            assert a.top_logprobs == pytest.approx(b.top_logprobs, abs=1e-4)
    for ours, theirs in zip(scores, expected_scores, strict=True):
        assert ours.prompt_logprobs[0] is None
        for a, b in zip(ours.prompt_logprobs[1:], theirs.prompt_logprobs[1:], strict=True):
            assert a.token_id == b.token_id
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
    assert [o.token_ids for o in forward] == [o.token_ids for o in backward]
