"""Repetition, frequency and presence penalties, applied sparsely.

A penalty only touches the ids a row has seen, a few hundred out of a vocabulary of ~50k-150k.
So instead of dense [rows, vocab] count tensors, each (row, id) pair becomes one key
``row * vocab + id`` into the flattened logits; ``unique`` turns the keys into distinct pairs with
their counts, and the logits at those keys are gathered, changed and written back. The cost
follows the histories' length, not rows x vocab.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from yaied.core.request import SamplingParams


@dataclass(slots=True)
class PenaltyTensors:
    """Distinct (row, id) keys into the flattened [rows * vocab] logits, with per-key settings."""

    output_keys: torch.Tensor  # [K] int64: ids in the row's output so far
    output_counts: torch.Tensor  # [K] fp32: how often each occurs there
    frequency: torch.Tensor  # [K] fp32: the key's row's frequency_penalty
    presence: torch.Tensor  # [K] fp32
    seen_keys: torch.Tensor | None  # [S] int64: ids in prompt or output; None: no repetition
    repetition: torch.Tensor | None  # [S] fp32


def build_penalties(
    params: Sequence[SamplingParams],
    prompt_ids: Sequence[list[int] | None] | None,
    output_ids: Sequence[list[int] | None] | None,
    vocab_size: int,
    device: torch.device,
) -> PenaltyTensors:
    """prompt_ids and output_ids are aligned with params; None (or a None entry) is empty. Ids
    must be below vocab_size (the engine checks prompts; sampled ids always are)."""
    freq_rows = [r for r, p in enumerate(params) if p.frequency_penalty or p.presence_penalty]
    rep_rows = [r for r, p in enumerate(params) if p.repetition_penalty != 1.0]
    outputs = output_ids or [None] * len(params)
    prompts = prompt_ids or [None] * len(params)

    def per_row(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device)

    output_keys, counts = _distinct_keys([(r, outputs[r]) for r in freq_rows], vocab_size, device)
    rows_of_output = output_keys // vocab_size
    seen_keys = repetition = None
    if rep_rows:
        histories = [(r, prompts[r]) for r in rep_rows] + [(r, outputs[r]) for r in rep_rows]
        seen_keys, _ = _distinct_keys(histories, vocab_size, device)
        repetition = per_row([p.repetition_penalty for p in params])[seen_keys // vocab_size]
    return PenaltyTensors(
        output_keys=output_keys,
        output_counts=counts.float(),
        frequency=per_row([p.frequency_penalty for p in params])[rows_of_output],
        presence=per_row([p.presence_penalty for p in params])[rows_of_output],
        seen_keys=seen_keys,
        repetition=repetition,
    )


def _distinct_keys(
    histories: list[tuple[int, list[int] | None]], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct ``row * vocab + id`` keys of the (row, token ids) histories, and their counts."""
    flat: list[int] = []
    for _, tokens in histories:
        flat += tokens or ()  # list.extend runs in C: no per-token Python work
    rows = torch.tensor([row for row, _ in histories], dtype=torch.int64)
    lengths = torch.tensor([len(tokens or ()) for _, tokens in histories], dtype=torch.int64)
    keys = rows.repeat_interleave(lengths) * vocab_size + torch.tensor(flat, dtype=torch.int64)
    return torch.unique(keys.to(device), return_counts=True)


def apply_penalties(logits: torch.Tensor, p: PenaltyTensors) -> None:
    """In place on contiguous logits [rows, vocab]: repetition first (transformers' rule), then
    frequency and presence (OpenAI's), as vLLM orders them."""
    flat = logits.view(-1)
    if p.seen_keys is not None and p.repetition is not None:
        seen = flat[p.seen_keys]
        # Either sign moves toward "less likely": divide positive logits, multiply negative.
        flat[p.seen_keys] = torch.where(seen > 0, seen / p.repetition, seen * p.repetition)
    if p.output_keys.numel():
        penalty = p.frequency * p.output_counts + p.presence
        flat[p.output_keys] = flat[p.output_keys] - penalty
