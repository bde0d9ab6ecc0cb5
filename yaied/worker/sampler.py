"""Sampling, vectorised over the batch: every knob is a per-row tensor, so one batch may mix greedy
and random requests with different temperatures, top-k, top-p and min-p."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from yaied.request import SamplingParams


@dataclass(slots=True)
class SamplingTensors:
    """Per-row sampling settings, built once per step from the requests' SamplingParams."""

    temperature: torch.Tensor  # [rows] fp32; greedy rows hold 1.0 and are taken by argmax
    top_k: torch.Tensor  # [rows] int64; vocab size where disabled
    top_p: torch.Tensor  # [rows] fp32
    min_p: torch.Tensor  # [rows] fp32
    greedy: torch.Tensor  # [rows] bool
    all_greedy: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool

    @classmethod
    def build(
        cls, params: list[SamplingParams], vocab_size: int, device: torch.device
    ) -> SamplingTensors:
        greedy = [p.greedy for p in params]
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        random_rows = [p for p, g in zip(params, greedy, strict=True) if not g]
        return cls(
            temperature=torch.tensor(
                [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)],
                dtype=torch.float32,
                device=device,
            ),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            all_greedy=all(greedy),
            need_top_k=any(0 < p.top_k < vocab_size for p in random_rows),
            need_top_p=any(p.top_p < 1.0 for p in random_rows),
            need_min_p=any(p.min_p > 0.0 for p in random_rows),
        )


def sample(
    logits: torch.Tensor, t: SamplingTensors, generator: torch.Generator | None = None
) -> torch.Tensor:
    """logits: [rows, vocab] fp32. Returns the sampled token ids [rows] int64."""
    greedy_ids = logits.argmax(dim=-1)
    if t.all_greedy:
        return greedy_ids
    logits = logits / t.temperature.unsqueeze(1)
    if t.need_top_k or t.need_top_p:
        logits = _apply_top_k_top_p(logits, t)
    probs = torch.softmax(logits, dim=-1)
    if t.need_min_p:
        # min-p keeps tokens whose probability is at least min_p times the most likely one's.
        threshold = probs.amax(dim=-1, keepdim=True) * t.min_p.unsqueeze(1)
        probs = probs.masked_fill(probs < threshold, 0.0)
    # Sampling by the exponential race: argmax(p / E) with E ~ Exp(1) draws from p, needs no
    # renormalisation and runs the same on every device.
    noise = torch.empty_like(probs).exponential_(generator=generator)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(t.greedy, greedy_ids, sampled)


def _apply_top_k_top_p(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    drop = ranks >= t.top_k.unsqueeze(1)
    if t.need_top_p:
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before
        # it already does. The top token is always kept.
        mass_before = probs.cumsum(dim=-1) - probs
        drop |= mass_before >= t.top_p.unsqueeze(1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
