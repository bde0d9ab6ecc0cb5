"""The vectorised sampler: each knob checked against a direct computation, rows independent."""

from __future__ import annotations

import torch

from yaied.request import SamplingParams
from yaied.worker.sampler import SamplingTensors, process_logits, sample

VOCAB = 8


def draw(
    logits: torch.Tensor, params: list[SamplingParams], n: int = 4000, **rows: object
) -> torch.Tensor:
    """Sample n times per row; returns empirical frequencies [rows, vocab]. ``rows``: the
    per-row keyword lists of SamplingTensors.build."""
    tensors = SamplingTensors.build(params, VOCAB, torch.device("cpu"), **rows)
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(len(params), VOCAB)
    for _ in range(n):
        ids = sample(logits.clone(), tensors, generator)
        counts[torch.arange(len(params)), ids] += 1
    return counts / n


LOGITS = torch.tensor([[3.0, 2.5, 2.0, 1.0, 0.5, 0.0, -1.0, -2.0]])


def test_greedy_takes_argmax_and_mixes_with_random_rows():
    logits = torch.randn(3, VOCAB)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(top_k=1, temperature=0.7),
    ]
    tensors = SamplingTensors.build(params, VOCAB, torch.device("cpu"))
    out = sample(logits, tensors, torch.Generator().manual_seed(1))
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()


def test_temperature_matches_softmax():
    freq = draw(LOGITS, [SamplingParams(temperature=0.5)])[0]
    expected = torch.softmax(LOGITS[0] / 0.5, -1)
    assert torch.allclose(freq, expected, atol=0.03)


def test_top_k_keeps_only_k_tokens():
    freq = draw(LOGITS, [SamplingParams(temperature=1.0, top_k=3)])[0]
    assert freq[3:].sum() == 0
    expected = torch.softmax(LOGITS[0, :3], -1)
    assert torch.allclose(freq[:3], expected, atol=0.03)


def test_top_p_keeps_smallest_prefix_reaching_p():
    probs = torch.softmax(LOGITS[0], -1)  # 0.41, 0.25, 0.15, ...
    p = float(probs[0] + probs[1]) - 0.01  # needs the first two tokens
    freq = draw(LOGITS, [SamplingParams(temperature=1.0, top_p=p)])[0]
    assert freq[2:].sum() == 0
    assert torch.allclose(freq[:2], probs[:2] / probs[:2].sum(), atol=0.03)


def test_min_p_drops_tokens_below_fraction_of_top():
    probs = torch.softmax(LOGITS[0], -1)
    min_p = 0.3  # keeps tokens with p >= 0.3 * p_max
    keep = probs >= min_p * probs.max()
    freq = draw(LOGITS, [SamplingParams(temperature=1.0, min_p=min_p)])[0]
    assert freq[~keep].sum() == 0
    assert torch.allclose(freq[keep], probs[keep] / probs[keep].sum(), atol=0.03)


def test_rows_use_their_own_settings():
    logits = LOGITS.repeat(2, 1)
    freq = draw(logits, [SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0)])
    assert freq[0, 2:].sum() == 0
    assert freq[1, 2:].sum() > 0


# --- logit_bias, penalties, min_tokens, seeds ---------------------------------------------------


def direct_processing(
    logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int], banned=()
) -> torch.Tensor:
    """The knobs written out token by token, as the OpenAI and transformers docs state them."""
    out = logits.clone()
    for token, bias in p.logit_bias:
        out[token] += bias
    for token in set(prompt) | set(output):  # repetition: prompt + output
        value = float(out[token])
        out[token] = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
    for token in set(output):  # frequency and presence: output only
        count = output.count(token)
        out[token] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    for token in banned:
        out[token] = float("-inf")
    return out


def test_bias_and_penalties_match_direct_formula():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(3)) * 2
    params = [
        SamplingParams(
            repetition_penalty=1.3,
            frequency_penalty=0.4,
            presence_penalty=-0.7,
            logit_bias={1: 2.5, 6: -1.0},
        ),
        SamplingParams(),  # untouched, between two processed rows
        SamplingParams(frequency_penalty=1.5, logit_bias={"4": 300}),  # clamped to 100
    ]
    prompts = [[0, 1, 1, 5], None, [2, 3]]
    outputs = [[1, 2, 2, 7, 2], None, [4, 4, 6]]
    tensors = SamplingTensors.build(
        params, VOCAB, torch.device("cpu"), prompt_ids=prompts, output_ids=outputs
    )
    ours = process_logits(logits, tensors)
    for row, p in enumerate(params):
        expected = direct_processing(logits[row], p, prompts[row] or [], outputs[row] or [])
        torch.testing.assert_close(ours[row], expected)
    assert ours[2, 4] > 90  # the bias was clamped, not dropped
    assert not torch.equal(ours[0], logits[0])


def test_greedy_with_penalties_is_argmax_of_processed_logits():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(4))
    top = logits.argmax(-1).tolist()
    params = [
        SamplingParams(temperature=0.0, frequency_penalty=2.0),
        SamplingParams(temperature=0.0, presence_penalty=2.0, repetition_penalty=2.0),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logit_bias={(top[3] + 1) % VOCAB: 100}),
    ]
    outputs = [[top[0]] * 3, [top[1]], None, None]
    tensors = SamplingTensors.build(params, VOCAB, torch.device("cpu"), output_ids=outputs)
    ids = sample(logits, tensors)
    for row, p in enumerate(params):
        expected = direct_processing(logits[row], p, [], outputs[row] or []).argmax()
        assert ids[row] == expected
    assert ids[0] != top[0] and ids[2] == top[2] and ids[3] == (top[3] + 1) % VOCAB


def test_min_tokens_bans_eos_and_stop_ids():
    logits = LOGITS.repeat(3, 1)  # token 0 is the most likely, then 1, 2...
    params = [SamplingParams(temperature=0.0, min_tokens=2)] * 2 + [SamplingParams()]
    banned = [(0, 2), (), ()]  # row 1 has reached min_tokens: nothing banned any more
    tensors = SamplingTensors.build(params, VOCAB, torch.device("cpu"), banned_ids=banned)
    assert sample(LOGITS.repeat(3, 1), tensors)[:2].tolist() == [1, 0]
    freq = draw(logits, params, n=500, banned_ids=banned)
    assert freq[0, 0] == 0 and freq[0, 2] == 0 and freq[2, 0] > 0
    assert torch.equal(process_logits(logits, tensors)[1:], logits[1:])


def seeded_draws(rows: list[tuple[torch.Tensor, SamplingParams]], steps: int, seed: int):
    """Draw `steps` tokens for each row; row r at step i has produced i output tokens."""
    logits = torch.stack([row_logits for row_logits, _ in rows])
    params = [p for _, p in rows]
    generator = torch.Generator().manual_seed(seed)
    draws = []
    for step in range(steps):
        tensors = SamplingTensors.build(
            params, VOCAB, torch.device("cpu"), num_output_tokens=[step] * len(rows)
        )
        draws.append(sample(logits, tensors, generator))
    return torch.stack(draws, dim=1)  # [rows, steps]


def test_seeded_rows_draw_the_same_whatever_the_batch():
    seeded = SamplingParams(temperature=1.0, seed=1234)
    other_logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(5))
    alone = seeded_draws([(LOGITS[0], seeded)], 200, seed=0)[0]
    crowded = seeded_draws(
        [
            (other_logits[0], SamplingParams(temperature=0.8)),
            (other_logits[1], SamplingParams(temperature=0.0)),
            (LOGITS[0], seeded),
            (other_logits[2], SamplingParams(temperature=1.0, seed=99, top_k=3)),
        ],
        200,
        seed=1,  # the shared generator is in another state too
    )
    assert torch.equal(alone, crowded[2])
    assert len(set(alone.tolist())) > 3  # a fresh draw each step, not one repeated token
    other_seed = seeded_draws([(LOGITS[0], SamplingParams(temperature=1.0, seed=1235))], 200, 0)
    assert not torch.equal(alone, other_seed[0])


def test_seeded_draws_follow_the_distribution():
    seeded = SamplingParams(temperature=0.5, seed=7)
    ids = seeded_draws([(LOGITS[0], seeded)], 3000, seed=0)[0]
    freq = torch.bincount(ids, minlength=VOCAB) / len(ids)
    assert torch.allclose(freq, torch.softmax(LOGITS[0] / 0.5, -1), atol=0.03)


def test_unseeded_rows_stay_random_beside_seeded_ones():
    rows = [(LOGITS[0], SamplingParams(temperature=1.0, seed=3)), (LOGITS[0], SamplingParams())]
    first = seeded_draws(rows, 100, seed=0)
    second = seeded_draws(rows, 100, seed=1)
    assert torch.equal(first[0], second[0])
    assert not torch.equal(first[1], second[1])


def test_top_candidates_shortcut_equals_full_sort(monkeypatch):
    """top-k/top-p over the best candidates gives exactly what sorting the whole vocabulary
    gives, including rows whose top_p mass lies beyond the candidates (they fall back)."""
    from yaied.worker import sampler as sampler_module

    torch.manual_seed(0)
    vocab = 3000
    logits = torch.randn(6, vocab) * torch.tensor([[0.5], [3.0], [8.0], [1.0], [2.0], [0.2]])
    params = [
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=1.0, top_p=0.5, top_k=40),
        SamplingParams(temperature=1.0, top_k=7),
        SamplingParams(temperature=1.0, top_p=0.99),  # needs far more than 64 candidates
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.0, top_p=0.3),
    ]
    tensors = SamplingTensors.build(params, vocab, torch.device("cpu"))

    def full(x):
        return sampler_module._filter_sorted(x, *x.sort(dim=-1, descending=True), tensors)

    expected = full(logits)
    for candidates in (64, 512):
        monkeypatch.setattr(sampler_module, "TOP_CANDIDATES", candidates)
        got = sampler_module._apply_top_k_top_p(logits, tensors)
        assert torch.equal(got.isinf(), expected.isinf())
        torch.testing.assert_close(got[~got.isinf()], expected[~expected.isinf()])
    # and without the hard rows, the shortcut itself (no fallback) is taken and still exact
    easy = [1, 2, 4]
    tensors = SamplingTensors.build([params[i] for i in easy], vocab, torch.device("cpu"))
    monkeypatch.setattr(sampler_module, "TOP_CANDIDATES", 512)
    sorts = []
    monkeypatch.setattr(torch.Tensor, "sort", lambda *a, **k: sorts.append(1) or 1 / 0)
    got = sampler_module._apply_top_k_top_p(logits[easy], tensors)
    assert not sorts  # the partial sort sufficed
    expected = sampler_module._filter_sorted(
        logits[easy], *torch.sort(logits[easy], dim=-1, descending=True), tensors
    )
    expected[2] = logits[4]  # the unfiltered row keeps every token
    torch.testing.assert_close(got, expected)
