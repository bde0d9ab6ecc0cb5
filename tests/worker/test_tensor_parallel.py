"""Tensor parallelism on CPU with gloo: a rank's shard is exactly its slice of the whole model,
and TP=2 computes the same logits as TP=1 (fp32) at prefill, decode, over a cached prefix and in
mixed batches, with the engine's prefix-cache hits and preemptions on top."""

from __future__ import annotations

import dataclasses
import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from yaied import LLM, SamplingParams
from yaied.core.config import load_config
from yaied.core.step import ScheduledSeq
from yaied.worker.loader import resolve_model_config
from yaied.worker.model_files import iter_safetensors_weights
from yaied.worker.models import build_model
from yaied.worker.models.llama import LlamaShape
from yaied.worker.parallel.group import RankGroup
from yaied.worker.parallel.layers import build_shard_model
from yaied.worker.parallel.loading import resolve_shape
from yaied.worker.parallel.plan import ShardPlan, check_divisible, iter_shard_weights
from yaied.worker.worker import Worker

GREEDY = SamplingParams(max_tokens=1, temperature=0.0)


def shape(**changes) -> LlamaShape:
    base = dict(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        qkv_bias=False,
        qk_norm=False,
        mlp_bias=False,
    )
    return LlamaShape(**(base | changes))


def test_unsplittable_models_are_refused_naming_the_numbers():
    with pytest.raises(ValueError, match="9 attention heads are not divisible by 2"):
        check_divisible(shape(num_heads=9, num_kv_heads=3), 2)
    with pytest.raises(ValueError, match="6 KV heads are not divisible by 4"):
        check_divisible(shape(num_heads=12, num_kv_heads=6), 4)
    with pytest.raises(ValueError, match="intermediate size 100 is not divisible by 3"):
        check_divisible(shape(num_heads=9, num_kv_heads=3, intermediate_size=100), 3)
    check_divisible(shape(num_heads=9, num_kv_heads=3, intermediate_size=1536), 3)  # the default


def test_kv_heads_are_replicated_when_fewer_than_ranks():
    plans = [ShardPlan(shape(num_heads=8, num_kv_heads=2), rank, 4) for rank in range(4)]
    assert [p.num_kv_heads for p in plans] == [1, 1, 1, 1]
    assert [p.first_kv_head for p in plans] == [0, 0, 1, 1]  # query heads 0-3 read kv head 0
    assert [p.vocab_start for p in plans] == [0, 25, 50, 75]


def test_refusals_happen_before_any_rank_starts(tiny_model_dirs):
    folder = tiny_model_dirs["llama"]
    config = load_config(overrides={"model": str(folder), "tensor_parallel_size": 3})
    with pytest.raises(ValueError, match="4 attention heads are not divisible by 3"):
        resolve_shape(config)
    config = load_config(
        overrides={"model": str(folder), "tensor_parallel_size": 2, "model_impl": "transformers"}
    )
    with pytest.raises(ValueError, match="transformers-backed path .* one device"):
        resolve_shape(config)


@pytest.mark.parametrize("kind", ["qwen2", "llama3-scaled"])
def test_each_rank_loads_exactly_its_slice(tiny_model_dirs, kind):
    """Biased q/k/v (qwen2), one replicated KV head and tied, padded vocab rows (llama3-scaled):
    every shard parameter equals its slice of the whole model's, read without the whole file."""
    folder = tiny_model_dirs[kind]
    _, hf_config = resolve_model_config(load_config(overrides={"model": str(folder)}).model)
    whole = build_model(hf_config, torch.device("cpu"))
    whole.load_weights(iter_safetensors_weights(folder, show_progress=False))
    full = dict(whole.named_parameters())
    world = 2
    for rank in range(world):
        plan = ShardPlan(LlamaShape.from_hf_config(hf_config), rank, world)
        group = RankGroup(rank, world, torch.device("cpu"), 1.0)
        shard = build_shard_model(hf_config, plan, group, torch.device("cpu"), torch.float32)
        shard.load_weights(iter_shard_weights(folder, plan))
        qkv = shard.layers[0].self_attn.qkv_proj.weight
        q, kv, d = plan.num_heads * 16, plan.num_kv_heads * 16, 16
        want_q = full["layers.0.self_attn.qkv_proj.weight"][rank * q : (rank + 1) * q]
        k_start = 4 * d + plan.first_kv_head * d  # whole: 4 query heads, then the KV heads
        want_k = full["layers.0.self_attn.qkv_proj.weight"][k_start : k_start + kv]
        assert torch.equal(qkv[:q], want_q) and torch.equal(qkv[q : q + kv], want_k)
        if kind == "qwen2":
            bias = full["layers.0.self_attn.qkv_proj.bias"]
            assert torch.equal(shard.layers[0].self_attn.qkv_proj.bias[:q], bias[rank * q :][:q])
        o = full["layers.0.self_attn.o_proj.weight"][:, rank * q : (rank + 1) * q]
        assert torch.equal(shard.layers[0].self_attn.o_proj.weight, o)
        rows = shard.embed_tokens.weight
        want = full["embed_tokens.weight"][plan.vocab_start : plan.vocab_start + len(rows)]
        assert torch.equal(rows[: len(want)], want) and not rows[len(want) :].any()
        assert shard.lm_head.weight is rows or kind != "llama3-scaled"  # tied stays tied


class WorkerThread:
    """A Worker built and stepped in a thread of its own, as the engine does (rank 0 binds its
    thread to its share of the cores: never the test's own thread)."""

    def __init__(self, folder, tp: int) -> None:
        overrides = {"model": str(folder), "dtype": "float32", "tensor_parallel_size": tp}
        self.pool = ThreadPoolExecutor(1)
        self.worker = self.pool.submit(Worker, load_config(overrides=overrides)).result()

    def logits(self, seqs: list[ScheduledSeq]) -> torch.Tensor:
        def run():
            with torch.inference_mode():
                hidden, _, _ = self.worker.runner._forward(seqs)
                return self.worker.runner.model.compute_logits(hidden)

        return self.pool.submit(run).result()

    def close(self) -> None:
        self.worker.close()
        self.pool.shutdown()


@pytest.fixture(scope="module")
def workers(tiny_model_dirs):
    pair = [WorkerThread(tiny_model_dirs["llama"], tp) for tp in (1, 2)]
    yield pair
    for worker in pair:
        worker.close()


def seq(name: str, tokens: list[int], start: int, pages: list[int]) -> ScheduledSeq:
    return ScheduledSeq(name, tokens, start, pages, True, GREEDY)


def test_tp2_logits_equal_tp1_at_prefill_decode_and_over_a_cached_prefix(workers):
    rng = random.Random(0)
    a = [rng.randrange(256) for _ in range(20)]
    b = [rng.randrange(256) for _ in range(13)]
    c_tail = [rng.randrange(256) for _ in range(14)]  # c shares a's first page (16 tokens)
    steps = [
        [seq("a", a, 0, [0, 1]), seq("b", b, 0, [2])],  # two fresh prefills
        # mixed: two decodes and a chunk over a cached page (a prefix hit)
        [seq("a", [7], 20, [0, 1]), seq("b", [9], 13, [2]), seq("c", c_tail, 16, [0, 3])],
        [seq("c", [5], 30, [0, 3]), seq("a", [3], 21, [0, 1])],  # decodes only
    ]
    for step in steps:
        one, two = (w.logits(step) for w in workers)
        assert one.shape == two.shape == (sum(len(s.token_ids) for s in step), 256)
        # fp32 tolerance: the all-reduce sums the ranks' partial products in another order than
        # one rank's matmul, and the CPU prefill kernel's blocked softmax rounds on its own.
        torch.testing.assert_close(two, one, rtol=1e-4, atol=1e-4)
    assert workers[1].worker.parallel.group.num_collectives > 0


def test_tp2_engine_matches_tp1_with_prefix_hits_preemption_and_mixed_batches(tiny_model_dirs):
    """llama3-scaled: one KV head (replicated on both ranks), tied embeddings. The same page
    count at both sizes (a TP=2 rank holds half of each page) so both schedule alike."""
    folder = tiny_model_dirs["llama3-scaled"]
    rng = random.Random(3)
    prefix = [rng.randrange(256) for _ in range(40)]
    tails = [[rng.randrange(256) for _ in range(rng.randint(40, 80))] for _ in range(12)]
    prompts = [prefix + tail for tail in tails]  # ~90 pages asked of 70: preemptions
    params = SamplingParams(
        max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=2
    )
    # 2 layers x 1 KV head x 16 dims x 2 (K, V) x 4 bytes x 16 tokens = 4 KiB a page at TP=1.
    pages, page_bytes = 70, 4096
    results, stats = {}, {}
    for tp in (1, 2):
        with LLM(
            str(folder),
            dtype="float32",
            tensor_parallel_size=tp,
            kv_cache_gib=pages * page_bytes / 2**30,
            max_num_batched_tokens=96,  # chunks mixed with decodes
            show_progress=False,
        ) as llm:
            assert llm.stats()["num_pages"] == pages
            # Prompt logprobs need every prompt row computed: the second pass, without them,
            # hits the prefix cache.
            again = dataclasses.replace(params, prompt_logprobs=None)
            results[tp] = llm.generate(prompts, params) + llm.generate(prompts[::-1], again)
            stats[tp] = llm.stats()
    for one, two in zip(results[1], results[2], strict=True):
        assert two.token_ids == one.token_ids
        ones = one.logprobs + (one.prompt_logprobs or [None])[1:]
        twos = two.logprobs + (two.prompt_logprobs or [None])[1:]
        for x, y in zip(ones, twos, strict=True):
            assert y.top_ids == x.top_ids
            assert y.top_logprobs == pytest.approx(x.top_logprobs, abs=1e-4)
    for key in ("num_preemptions", "prefix_cache_hits"):
        assert stats[2][key] == stats[1][key] > 0, key
