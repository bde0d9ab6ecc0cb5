"""The step contract: what the scheduler hands the worker each step, and what comes back.

    engine task                         worker thread
    Scheduler.schedule() -> Batch  ---> Worker.execute(batch)
    Scheduler.update(batch, out)  <---  StepOutput

Both sides import this module and nothing of each other: the worker never sees a live Request
(each ScheduledSeq holds what one step needs), and the engine never sees a tensor. A ScheduledSeq's
lists (page table, penalty histories) are the request's own, shared rather than copied so that a
step costs nothing per context token: the engine leaves them alone until the step's update, and
the worker only reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from yaied.core.request import SamplingParams, TokenLogprobs


@dataclass(slots=True)
class ScheduledSeq:
    """One request's share of a step. Lists are the request's own (read-only for the worker)."""

    request_id: str
    token_ids: list[int]  # the tokens computed this step, at positions start_pos, start_pos + 1...
    start_pos: int
    page_ids: list[int]  # the request's page table (covering at least up to the chunk's end)
    sample: bool  # the chunk ends at the request's last token: sample the next one
    params: SamplingParams
    # What the sampler needs beyond params; each is filled only when its knob is set.
    num_output_tokens: int = 0  # output tokens so far: a seeded draw uses (seed, this)
    penalty_prompt_ids: list[int] | None = None  # the prompt, for repetition_penalty
    penalty_output_ids: list[int] | None = None  # the output so far, for any penalty
    banned_token_ids: tuple[int, ...] = ()  # EOS and stop ids, while output < min_tokens
    # prompt_logprobs: row i of the chunk (position start_pos + i) scores the prompt token at
    # position start_pos + i + 1, which is prompt_logprob_targets[i]. The last row of a chunk
    # that does not finish the prompt scores the next chunk's first token; the last prompt row
    # scores nothing (it samples). None when not asked for.
    prompt_logprob_targets: list[int] | None = None
    # A constrained sequence that samples: the row of batch.grammar_bitmask that holds the
    # tokens its grammar allows next (the engine filled it before handing the batch over). The
    # worker masks this sequence's logits with it before any other processing. None: free text.
    grammar_row: int | None = None
    # Speculative decoding: the last num_draft_tokens of token_ids are guesses of the tokens
    # after the request's last one (yaied/engine/speculative.py). The worker samples at every
    # position from the last real token on (logits rows in order, grammar rows grammar_row,
    # grammar_row + 1...) and keeps the drafts up to the first the model disagrees with.
    num_draft_tokens: int = 0


@dataclass(slots=True)
class Batch:
    seqs: list[ScheduledSeq]  # single-token sequences first, then multi-token prefill chunks
    num_tokens: int
    # The engine's persistent token bitmask (a yaied.structured.TokenBitmask, opaque here),
    # when a sequence of the step has a grammar_row. One host buffer serves every step: the
    # engine fills it only between steps, never while the worker runs one.
    grammar_bitmask: Any = None
    # A step scheduled while the one before it still runs (engine/lookahead.py): sequence
    # i's input token is the one that step samples for its sampling row previous_rows[i] (rows
    # in its batch order), read on the device; token_ids hold a placeholder. None: every input
    # token is in token_ids.
    previous_rows: list[int] | None = None

    @property
    def num_sampled(self) -> int:
        return sum(seq.sample for seq in self.seqs)


@dataclass(slots=True)
class StepOutput:
    """The worker's answer: one sampled token per sampling sequence, in batch order."""

    # One per sampling sequence; a row named in `failed` holds a meaningless id.
    sampled_token_ids: list[int]
    # The whole step failed (nothing was computed): every request in it fails with this message.
    error: str | None = None
    # The failure cannot be recovered in this process (a CUDA error): the engine stops.
    fatal: bool = False
    # Request id -> why that request alone failed this step: its chunk's values were not finite
    # (NaN or inf, which would sample garbage and poison the prefix cache), or it failed when
    # run by itself after the whole step had failed. The engine fails these before caching.
    failed: dict[str, str] = field(default_factory=dict)
    model_time: float = 0.0
    # Aligned with sampled_token_ids (None for rows that did not ask); None when no row asked.
    sampled_logprobs: list[TokenLogprobs | None] | None = None
    # Per request id, the prompt tokens scored by this step's chunk: a leading None for
    # position 0 when the chunk starts there, then one entry per prompt_logprob_targets item.
    # Concatenated over a prompt's chunks: one entry per prompt token.
    prompt_logprobs: dict[str, list[TokenLogprobs | None]] = field(default_factory=dict)
    mask_time: float = 0.0  # seconds the worker spent applying grammar masks (metrics)
    # Speculative decoding, aligned with sampled_token_ids: how many of each sequence's draft
    # tokens the model accepted; they come before its sampled token in the output. None when no
    # sequence of the step had drafts.
    num_accepted_drafts: list[int] | None = None
    # The accepted drafts' logprobs, by request id, for the sequences that asked for logprobs.
    draft_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Pooling sequences (params.pooling), by request id: "mean", the sum of this chunk's final
    # hidden rows (the engine adds the chunks up and divides by the prompt's length); "last",
    # the last prompt row's, from the chunk that samples. Float32 values.
    pooled: dict[str, list[float]] = field(default_factory=dict)
