"""engine.batch_invariant: a request's tokens and logprobs are the same bits alone and in a
crowd (yaied/worker/batch_invariant.py)."""

from __future__ import annotations

import random

import pytest
import torch

from tests.cpu_levels import kernel_at
from yaied import LLM, SamplingParams
from yaied.core.config import load_config
from yaied.kernels.cpu_gemv import CpuGemv
from yaied.worker.batch_invariant import check_device

NEW_TOKENS = 20


def crowd() -> tuple[list[list[int]], list[SamplingParams]]:
    """14 prompts of 3-70 tokens, five of them sharing a 35-token prefix (the prefix cache then
    serves it to some and not to others) and the last two the same 33 tokens (alone, the second
    finds all but its last token cached: a lone prompt token), greedy but for one seeded draw,
    with logprobs."""
    rng = random.Random(5)
    shared = [rng.randrange(256) for _ in range(35)]
    prompts = [[rng.randrange(256) for _ in range(rng.randint(3, 70))] for _ in range(12)]
    for i in range(0, 10, 2):
        prompts[i] = shared + prompts[i][:20]
    prompts += [shared[:33], shared[:33]]
    params = [
        SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)
        for _ in prompts
    ]
    params[3] = SamplingParams(
        max_tokens=NEW_TOKENS, temperature=0.8, seed=7, ignore_eos=True, logprobs=2
    )
    return prompts, params


def alone_and_together(folder, **options) -> tuple[list, list]:
    """Each prompt alone in one engine, then all at once in a fresh one. The small step budget
    cuts prompts into chunks (a lone last token among them) and mixes them with decodes, and
    14 streams decode more than eight rows a step. One thread: the kernels' tests cover thread
    counts, and two pytest workers share two cores."""
    prompts, params = crowd()
    runs = []
    for together in (False, True):
        with LLM(
            str(folder),
            kv_cache_gib=0.05,
            max_num_batched_tokens=40,
            batch_invariant=True,
            threads=1,
            show_progress=False,
            **options,
        ) as llm:
            if together:
                outs = llm.generate(prompts, params)
            else:
                outs = [llm.generate([p], [q])[0] for p, q in zip(prompts, params, strict=True)]
        assert all(len(o.token_ids) == NEW_TOKENS for o in outs)
        runs.append([(o.token_ids, o.logprobs) for o in outs])
    return runs[0], runs[1]


@pytest.mark.parametrize("dtype", ["bfloat16", "auto", "float32"])
def test_a_request_is_the_same_bits_alone_and_in_a_crowd(
    dtype, isa_level, tiny_model_dirs, monkeypatch
):
    """At every ISA level: bf16 math, dtype auto (fp32 math over bf16 weights below
    AVX512-BF16), and fp32 weights on the panel matmul (from avx2 up; below, F.linear cannot
    hold it and the start stops). Without the option the logprobs differ in the last bits."""
    kernel_at(CpuGemv, isa_level)
    monkeypatch.setenv("YAIED_CPU_ISA", isa_level)
    if dtype == "float32" and isa_level == "generic":
        with pytest.raises(ValueError, match=r"panel matmul\) on every linear layer"):
            alone_and_together(tiny_model_dirs["llama"], dtype=dtype)
        return
    alone, together = alone_and_together(tiny_model_dirs["llama"], dtype=dtype)
    assert together == alone


@pytest.mark.parametrize(
    "kind, quantization",
    [("qwen3", "none"), ("llama", "q4_0")],
    ids=["qk-norm", "quantized"],
)
def test_qk_norms_and_quantized_weights_hold_it_too(kind, quantization, tiny_model_dirs):
    """A model with q/k norms (applied between the projection and rotary), and quantized
    weights on cpu_quant.c's few-row kernel."""
    kernel_at(CpuGemv, "generic")  # skips where nothing builds
    alone, together = alone_and_together(
        tiny_model_dirs[kind], dtype="bfloat16", quantization=quantization
    )
    assert together == alone


def test_a_later_turn_and_a_preempted_request_go_on_from_the_same_bits(tiny_model_dirs):
    """Every token takes the prefill path, so the K/V the prefix cache hands on are the same
    bits as a fresh prompt's: a second turn that finds the first turn's answer cached, and
    requests preempted (a pool of 12 pages for eight streams of five) and recomputed, give what
    they give alone in a fresh engine."""
    kernel_at(CpuGemv, "generic")
    folder = str(tiny_model_dirs["llama"])
    rng = random.Random(9)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts = [[rng.randrange(256) for _ in range(40)] for _ in range(8)]
    small = dict(kv_cache_gib=12 * 16 * 256 / 2**30, max_model_len=128, max_num_seqs=8)
    with LLM(folder, dtype="bfloat16", batch_invariant=True, show_progress=False, **small) as llm:
        assert llm.engine.pool.num_pages == 12
        # the few-row kernel's copy is the only weight left (oneDNN's packed one went)
        head = llm.engine.worker.runner.model.lm_head
        assert head.packed is None and head.few_rows is not None
        crowded = llm.generate(prompts, params)
        assert llm.engine.stats()["num_preemptions"] > 0
        turn_one = llm.generate([prompts[0][:30]], params)[0]
        follow_up = prompts[0][:30] + turn_one.token_ids + [7, 8, 9]
        turn_two = llm.generate([follow_up], params)[0]
        assert turn_two.num_cached_tokens >= 64  # the first turn's answer among them
    options = dict(kv_cache_gib=0.05, batch_invariant=True, show_progress=False)
    with LLM(folder, dtype="bfloat16", **options) as llm:
        alone = [llm.generate([p], params)[0] for p in prompts]
    with LLM(folder, dtype="bfloat16", **options) as llm:
        fresh = llm.generate([follow_up], params)[0]
    for got, want in zip(crowded, alone, strict=True):
        assert (got.token_ids, got.logprobs) == (want.token_ids, want.logprobs)
    assert (turn_two.token_ids, turn_two.logprobs) == (fresh.token_ids, fresh.logprobs)


def test_the_default_model_prompt_cut_anywhere(default_model_folder):
    """The default model (head size 64, where the decode attention kernel's arithmetic is not
    the prefill kernel's, so a lone token on the decode path would differ): a prompt whose last
    token is all the prefix cache lacks, and one prefilled beside others, give the bits of the
    prompt prefilled alone and fresh."""
    kernel_at(CpuGemv, "generic")
    rng = random.Random(2)
    prompt = [rng.randrange(100, 20000) for _ in range(33)]
    others = [[rng.randrange(100, 20000) for _ in range(n)] for n in (50, 7, 90)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    options = dict(kv_cache_gib=0.05, max_model_len=512, max_num_batched_tokens=64)
    with LLM(
        str(default_model_folder), batch_invariant=True, show_progress=False, **options
    ) as llm:
        fresh = llm.generate([prompt], params)[0]
        cached = llm.generate([prompt], params)[0]  # 32 tokens from the cache, 1 computed
        crowded = llm.generate(others[:1] + [prompt + [11]] + others[1:], params)[1]
    with LLM(
        str(default_model_folder), batch_invariant=True, show_progress=False, **options
    ) as llm:
        alone = llm.generate([prompt + [11]], params)[0]
    assert cached.num_cached_tokens == 32
    assert (cached.token_ids, cached.logprobs) == (fresh.token_ids, fresh.logprobs)
    assert (crowded.token_ids, crowded.logprobs) == (alone.token_ids, alone.logprobs)


def test_what_the_option_cannot_hold_stops_the_start():
    base = {"batch_invariant": True}
    for overrides, message in (
        ({"speculative_method": "ngram"}, "speculative"),
        ({"tensor_parallel_size": 2}, "tensor parallelism"),
    ):
        with pytest.raises(ValueError, match=message):
            load_config(env={}, overrides={**base, **overrides})
    config = load_config(env={}, overrides={**base, "device": "cuda"})
    with pytest.raises(ValueError, match="CPU only"):
        check_device(config, torch.device("cuda"))
    check_device(load_config(env={}, overrides=base), torch.device("cpu"))
