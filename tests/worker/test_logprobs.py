"""Logprobs, prompt logprobs and penalties through the model runner, against transformers fp32.

The runner is driven directly with hand-built ScheduledSeqs, so each test says exactly which rows
a step holds: decodes first in the packed rows, then prefill chunks.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from yaied import LLM, SamplingParams
from yaied.core.request import TokenLogprobs
from yaied.core.step import Batch, ScheduledSeq

TOL = 1e-3


@pytest.fixture(scope="module")
def pair(tiny_model_dirs):
    folder = tiny_model_dirs["llama"]
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(str(folder), dtype="float32", kv_cache_gib=0.01, show_progress=False)
    yield reference, llm
    llm.close()


@pytest.fixture
def pages(pair):
    """Allocate pages for a sequence of n tokens; all are freed after the test."""
    pool = pair[1].engine.pool
    held: list[list[int]] = []

    def allocate(n: int) -> list[int]:
        held.append(pool.allocate(pool.pages_for(n)))
        return held[-1]

    yield allocate
    for page_ids in held:
        pool.free(page_ids)


def prompt_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(length)]


def reference_logprobs(reference, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab]: row p is the distribution of the token after tokens[: p + 1]."""
    with torch.no_grad():
        return torch.log_softmax(reference(torch.tensor([tokens])).logits[0].float(), -1)


def assert_matches(entry: TokenLogprobs, expected: torch.Tensor, token: int, n: int) -> None:
    """entry against a reference log-softmax row: the token's logprob and the top-n."""
    assert entry.token_id == token
    assert abs(entry.logprob - float(expected[token])) < TOL
    top = expected.topk(n)
    assert entry.top_ids == top.indices.tolist()
    torch.testing.assert_close(torch.tensor(entry.top_logprobs), top.values, atol=TOL, rtol=0.0)


def run(llm: LLM, seqs: list[ScheduledSeq]):
    out = llm.engine.worker.runner.execute(Batch(seqs, sum(len(s.token_ids) for s in seqs)))
    assert out.error is None
    return out


def test_sampled_logprobs_match_transformers(pair, pages):
    reference, llm = pair
    a, b = prompt_of(30, seed=1), prompt_of(17, seed=2)
    pa, pb = pages(40), pages(40)
    first = run(
        llm,
        [
            ScheduledSeq("a", a, 0, pa, True, SamplingParams(temperature=0.0, logprobs=5)),
            ScheduledSeq("b", b, 0, pb, True, SamplingParams(temperature=1.0)),
        ],
    )
    assert first.sampled_logprobs is not None and first.sampled_logprobs[1] is None
    token_a, token_b = first.sampled_token_ids
    assert_matches(first.sampled_logprobs[0], reference_logprobs(reference, a)[-1], token_a, 5)
    # A decode step; "b" now asks for the sampled token's logprob only, at temperature 1.
    second = run(
        llm,
        [
            ScheduledSeq("a", [token_a], len(a), pa, True, SamplingParams(logprobs=20)),
            ScheduledSeq("b", [token_b], len(b), pb, True, SamplingParams(logprobs=0)),
        ],
    )
    for row, (tokens, n) in enumerate([(a + [token_a], 20), (b + [token_b], 0)]):
        sampled = second.sampled_token_ids[row]
        expected = reference_logprobs(reference, tokens)[-1]
        assert_matches(second.sampled_logprobs[row], expected, sampled, n)


def test_no_logprobs_asked_gives_none(pair, pages):
    _, llm = pair
    prompt = prompt_of(12, seed=3)
    out = run(llm, [ScheduledSeq("a", prompt, 0, pages(12), True, SamplingParams())])
    assert out.sampled_logprobs is None and out.prompt_logprobs == {}


def test_prompt_logprobs_over_two_chunks_match_transformers(pair, pages):
    """A 40-token prompt in chunks of 24 and 16, the second over the first's cached K/V; a
    second request shares both steps (a fresh prefill, then a decode that takes the first row)."""
    reference, llm = pair
    prompt, other = prompt_of(40, seed=4), prompt_of(9, seed=5)
    px, py = pages(41), pages(12)
    params = SamplingParams(temperature=0.0, prompt_logprobs=3, logprobs=2)
    first = run(
        llm,
        [
            ScheduledSeq("y", other, 0, py, True, SamplingParams(temperature=0.0)),
            ScheduledSeq(
                "x", prompt[:24], 0, px, False, params, prompt_logprob_targets=prompt[1:25]
            ),
        ],
    )
    second = run(
        llm,
        [
            ScheduledSeq(
                "x", prompt[24:], 24, px, True, params, prompt_logprob_targets=prompt[25:]
            ),
            ScheduledSeq("y", first.sampled_token_ids[:1], 9, py, True, SamplingParams()),
        ],
    )
    assert list(first.prompt_logprobs) == ["x"] and list(second.prompt_logprobs) == ["x"]
    entries = first.prompt_logprobs["x"] + second.prompt_logprobs["x"]
    assert len(entries) == len(prompt) and entries[0] is None
    expected = reference_logprobs(reference, prompt)
    for pos in range(1, len(prompt)):
        assert_matches(entries[pos], expected[pos - 1], prompt[pos], 3)
    # The last prompt row samples; its logprob is the sampled token's, not a prompt entry.
    assert_matches(second.sampled_logprobs[0], expected[-1], second.sampled_token_ids[0], 2)


def direct_penalised(
    logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]
) -> torch.Tensor:
    out = logits.clone()
    for token, bias in p.logit_bias:
        out[token] += bias
    for token in set(prompt + output):
        value = float(out[token])
        out[token] = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
    for token in set(output):
        count = output.count(token)
        out[token] -= p.frequency_penalty * count + p.presence_penalty
    return out


def test_greedy_batch_with_penalties_is_argmax_of_penalised_logits(pair, pages):
    reference, llm = pair
    prompts = [prompt_of(n, seed=10 + n) for n in (20, 26, 33)]
    with torch.no_grad():
        logits = [reference(torch.tensor([p])).logits[0, -1].float() for p in prompts]
    top = [int(row.argmax()) for row in logits]
    params = [
        SamplingParams(temperature=0.0, frequency_penalty=2.0, presence_penalty=1.0),
        SamplingParams(temperature=0.0, repetition_penalty=3.0, logit_bias={top[1]: -0.5}),
        SamplingParams(temperature=0.0),  # untouched beside the others
    ]
    # Invented outputs so far, holding each row's raw favourite so the penalties bite.
    outputs = [[top[0]] * 3 + [5], [top[1], 7], []]
    seqs = [
        ScheduledSeq(
            f"r{i}",
            prompts[i],
            0,
            pages(len(prompts[i])),
            True,
            params[i],
            penalty_prompt_ids=prompts[i] if params[i].repetition_penalty != 1.0 else None,
            penalty_output_ids=outputs[i] if params[i].has_penalties else None,
        )
        for i in range(3)
    ]
    ours = run(llm, seqs).sampled_token_ids
    expected = [
        int(direct_penalised(logits[i], params[i], prompts[i], outputs[i]).argmax())
        for i in range(3)
    ]
    assert ours == expected
    assert ours[0] != top[0] and ours[2] == top[2]


def test_min_tokens_holds_back_stop_ids(pair):
    """End to end: a stop id that greedy decoding picks first cannot end the request before
    min_tokens outputs."""
    _, llm = pair
    prompt = prompt_of(15, seed=6)
    free = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    stops = sorted(set(free[0].token_ids[:3]))
    params = SamplingParams(
        temperature=0.0, max_tokens=8, min_tokens=4, stop_token_ids=stops, ignore_eos=True
    )
    held = llm.generate([prompt], params)[0]
    assert len(held.token_ids) >= 4
    assert not set(held.token_ids[:3]) & set(stops)


def test_seeded_request_repeats_whatever_the_batch(pair):
    _, llm = pair
    prompt = prompt_of(20, seed=7)
    seeded = SamplingParams(temperature=1.0, seed=42, max_tokens=12, ignore_eos=True)
    alone = llm.generate([prompt], seeded)[0].token_ids
    others = [prompt_of(10 + i, seed=20 + i) for i in range(3)]
    unseeded = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    crowded = llm.generate(others + [prompt], [unseeded] * 3 + [seeded])
    assert crowded[3].token_ids == alone
