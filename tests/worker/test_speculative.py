"""Speculative decoding through the whole engine on tiny models (fp32): greedy output and logprobs
identical with it on and off (chunked prefill, prefix hits, preemption, penalties, seeds, stop
strings, grammars), and sampled output distributed the same (a chi-squared test)."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest
from scipy.stats import chi2_contingency

from tests.conftest import TINY_CONFIGS, make_tiny_model
from tests.engine.engine_fuzz import write_byte_tokenizer
from yaied import LLM, SamplingParams
from yaied.core.grammar_spec import make_spec

SPEC = dict(speculative_method="ngram", num_speculative_tokens=4, speculative_max_batch_size=0)


@pytest.fixture(scope="module")
def looping_models(tmp_path_factory):
    """Tiny models with small weights: their greedy output settles into loops, which n-gram
    drafts predict, so steps accept some drafts and reject others."""
    root = tmp_path_factory.mktemp("spec-models")
    return {kind: make_tiny_model(kind, root / kind, std=0.08) for kind in TINY_CONFIGS}


def copying_prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
    """Random documents followed by the start of a copy of themselves."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        doc = [rng.randrange(vocab) for _ in range(rng.randint(8, 70))]
        prompts.append(doc + doc[: rng.randint(2, 6)])
    return prompts


def generate_both(folder, prompts, params, **settings):
    """(outputs with speculation off, with it on, the on engine's stats)."""
    runs = []
    for spec in ({}, SPEC):
        with LLM(str(folder), dtype="float32", show_progress=False, **settings, **spec) as llm:
            first = llm.generate(prompts, params)
            again = llm.generate(prompts[:4], params)  # prefix-cache hits, drafts from them
            runs.append((first + again, llm.stats()))
    (off, _), (on, stats) = runs
    assert stats["num_free_pages"] == stats["num_pages"]
    return off, on, stats


def assert_same(off, on) -> None:
    for a, b in zip(off, on, strict=True):
        assert b.token_ids == a.token_ids
        assert b.finish_reason == a.finish_reason and b.stop_reason == a.stop_reason
        assert b.text == a.text
        if a.logprobs is not None:
            assert len(b.logprobs) == len(b.token_ids)
            for x, y in zip(a.logprobs, b.logprobs, strict=True):
                assert x.token_id == y.token_id and x.top_ids == y.top_ids
                assert y.logprob == pytest.approx(x.logprob, abs=1e-4)


@pytest.mark.parametrize("kind", list(TINY_CONFIGS))
def test_greedy_output_is_the_same_with_speculation(looping_models, kind):
    prompts = copying_prompts(12, 256, seed=1)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, logprobs=2)
    # A small budget chunks prefills; 64 pages of 16 tokens for 16 requests preempt.
    settings = dict(max_num_batched_tokens=48, kv_cache_gib=64 * 16 * 1024 / 2**30)
    off, on, stats = generate_both(looping_models[kind], prompts, params, **settings)
    assert_same(off, on)
    accepted, drafted = (
        stats["spec_decode_num_accepted_tokens"],
        stats["spec_decode_num_draft_tokens"],
    )
    assert 0 < accepted < drafted  # drafts were accepted and rejected both


def test_penalties_bias_min_tokens_and_seeds(looping_models):
    prompts = copying_prompts(8, 256, seed=2)
    knobs = [
        dict(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.3),
        dict(temperature=0.0, repetition_penalty=1.3, logit_bias={5: 3.0}),
        dict(temperature=0.0, min_tokens=20, stop_token_ids=(7, 9)),
        dict(temperature=0.8, seed=11, frequency_penalty=0.2),
    ]
    params = [
        SamplingParams(max_tokens=40, logprobs=1, **knobs[i % len(knobs)])
        for i in range(len(prompts))
    ]
    llm_params = params + params[:4]
    runs = []
    for spec in ({}, SPEC):
        folder = str(looping_models["llama"])
        with LLM(folder, dtype="float32", show_progress=False, **spec) as llm:
            runs.append(llm.generate(prompts + prompts[:4], llm_params))
    assert_same(*runs)


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory):
    """The looping tiny llama with a byte-level tokenizer: text, stop strings, grammars."""
    folder = make_tiny_model("llama", tmp_path_factory.mktemp("bytes") / "llama", std=0.08)
    write_byte_tokenizer(folder)
    return folder


def test_stop_strings_inside_accepted_drafts(byte_model):
    prompts = copying_prompts(10, 256, seed=3)
    plain = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    with LLM(str(byte_model), dtype="float32", show_progress=False) as llm:
        texts = [out.text for out in llm.generate(prompts, plain)]
    # Stop strings from the middle of each output, so that the stop lands inside the accepted
    # drafts of some step (a multi-token step with speculation), and one that never occurs.
    params = []
    for i, text in enumerate(texts):
        cut = 20 + 3 * i
        stop = text[cut : cut + 2] or "never"
        params.append(
            SamplingParams(
                max_tokens=60,
                temperature=0.0,
                ignore_eos=True,
                stop=[stop, "\x00never"],
                include_stop_str_in_output=i % 2 == 0,
                logprobs=0,
            )
        )
    runs = []
    for spec in ({}, SPEC):
        with LLM(str(byte_model), dtype="float32", show_progress=False, **spec) as llm:
            runs.append(event_runs(llm, prompts, params))
            stats = llm.stats()
    assert runs[0] == runs[1]
    assert sum(finish == "stop" for _, _, finish, _ in runs[1]) >= 5
    assert stats["spec_decode_num_accepted_tokens"] > 0


def event_runs(llm: LLM, prompts, params) -> list[tuple]:
    """Per request: (tokens, text, finish reason, stop reason), checking that the final event's
    token count is the number of tokens the events carried (drafts after a stop are dropped)."""

    async def one(prompt, p):
        events = [event async for event in llm.engine.generate(prompt, p)]
        tokens = [t for event in events for t in event.token_ids]
        last = events[-1]
        assert last.num_output_tokens == len(tokens)
        text = "".join(event.text for event in events)
        return tokens, text, last.finish_reason, last.stop_reason

    async def all_of_them():
        return await asyncio.gather(*(one(pr, p) for pr, p in zip(prompts, params, strict=True)))

    return llm._loop.run_until_complete(all_of_them())


def test_grammars_check_the_drafts(byte_model):
    """Drafts the grammar refuses are cut before they are verified; what is accepted under the
    per-position bitmasks is what a plain constrained decode would give."""
    rng = random.Random(4)
    prompts = [[rng.choice(b"abcd") for _ in range(rng.randint(10, 40))] for _ in range(8)]
    spec = make_spec("regex", "[abc]{5,60}x", "structured_outputs.regex")
    params = SamplingParams(max_tokens=64, temperature=0.0, structured=spec, logprobs=1)
    seeded = SamplingParams(max_tokens=64, temperature=0.7, seed=5, structured=spec)
    runs = []
    for settings in ({}, SPEC):
        with LLM(str(byte_model), dtype="float32", show_progress=False, **settings) as llm:
            runs.append(llm.generate(prompts, [params] * 6 + [seeded] * 2))
            stats = llm.stats()
    assert_same(*runs)
    for out in runs[1]:
        assert set(out.text[:-1]) <= set("abc") and out.finish_reason in ("stop", "length")
    assert stats["spec_decode_num_accepted_tokens"] > 0


SMALL_VOCAB = {"v16": dict(TINY_CONFIGS["llama"], vocab_size=16)}


def test_sampled_distribution_is_unchanged(tmp_path):
    """3000 sampled continuations of one repetitive prompt from a 16-token model, speculation
    off and on: per position and for tokens 1 and 2 jointly, a chi-squared test of homogeneity
    does not tell the two apart. Deterministic (seeded generators). With every row forced to
    accept its first draft, p is below 1e-10 from position 1 on; with one row in 7 forced, one
    position falls below 1e-3."""
    folder = make_tiny_model("v16", tmp_path / "v16", std=0.5, configs=SMALL_VOCAB)
    prompt = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]
    params = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True)
    samples = []
    for spec in ({}, dict(SPEC, prompt_lookup_min=1)):
        with LLM(
            str(folder), dtype="float32", show_progress=False, max_num_seqs=256, **spec
        ) as llm:
            samples.append([tuple(o.token_ids) for o in llm.generate([prompt] * 3000, params)])
            stats = llm.stats()
    drafted = stats["spec_decode_num_draft_tokens"]
    assert 0.3 * drafted < stats["spec_decode_num_accepted_tokens"] < 0.8 * drafted
    views = [lambda s, i=i: s[i] for i in range(6)] + [lambda s: s[1:3]]
    for view in views:
        counts = [Counter(view(s) for s in run) for run in samples]
        # Cells with few samples make chi-squared unreliable: pool them into one.
        cells = sorted(set(counts[0]) | set(counts[1]), key=lambda c: -counts[0][c] - counts[1][c])
        common = [c for c in cells if counts[0][c] + counts[1][c] >= 20]
        table = [
            [cnt[c] for c in common] + [sum(cnt.values()) - sum(cnt[c] for c in common)]
            for cnt in counts
        ]
        if table[0][-1] + table[1][-1] == 0:
            table = [row[:-1] for row in table]
        p_value = chi2_contingency(table).pvalue
        assert p_value > 1e-3, (table, p_value)
