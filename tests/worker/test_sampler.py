"""The vectorised sampler: each knob checked against a direct computation, rows independent."""

from __future__ import annotations

import torch

from yaied.request import SamplingParams
from yaied.worker.sampler import SamplingTensors, sample

VOCAB = 8


def draw(logits: torch.Tensor, params: list[SamplingParams], n: int = 4000) -> torch.Tensor:
    """Sample n times per row; returns empirical frequencies [rows, vocab]."""
    tensors = SamplingTensors.build(params, VOCAB, torch.device("cpu"))
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
