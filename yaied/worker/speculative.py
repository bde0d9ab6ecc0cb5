"""Verifying speculative drafts: one logits row per position, then keep what the model agrees with.

A sequence with d draft tokens (``ScheduledSeq.num_draft_tokens``, proposed by
``yaied/engine/speculative.py``) ran through the forward pass as the chunk
``[last token, draft 1, ..., draft d]``. Its rows 0..d each give the distribution of the next
token after the drafts before them, so the worker samples a token at every row, each row with
the knobs as they would stand there (penalties over the output plus the drafts before it, the
min_tokens ban while the count is short, the grammar's bitmask row for that position, a seeded
draw's position), through the ordinary sampler.

Draft j + 1 is accepted when row j sampled exactly it; the sequence keeps the accepted drafts and
then the token its first disagreeing row (or, with every draft accepted, its last row) sampled.
For greedy rows that is the longest agreeing prefix plus the model's next token. For sampled rows
it is rejection sampling with a deterministic draft: the draft distribution q is one-hot on t, so
the rule "accept t with probability min(1, p(t) / q(t)) = p(t), else draw from the residual
max(0, p - q), renormalised, that is p without t" is exactly "draw x from p; accept t when x = t,
else emit x": P(accept) = p(t), and a rejected draw is distributed as p given x != t. Every row
draws independent noise, so each emitted token is drawn from the model's distribution given the
tokens before it, the same as without speculation (tests/worker/test_speculative.py checks it
with a chi-squared test). A seeded row draws its noise from (seed, output position), as a decode
does, so a seeded request usually reproduces its output without speculation; logits computed in a
verification pass can differ from a decode's in the last bits, so that is not guaranteed.
"""

from __future__ import annotations

import dataclasses

from yaied.core.request import TokenLogprobs
from yaied.core.step import ScheduledSeq, StepOutput


def position_rows(
    seqs: list[ScheduledSeq], first_row: dict[str, int]
) -> tuple[list[int], list[ScheduledSeq]]:
    """For the sampling sequences ``seqs`` (batch order): the hidden rows to sample, and one
    ScheduledSeq per row holding the sampling knobs as they stand at that position."""
    rows: list[int] = []
    per_row: list[ScheduledSeq] = []
    for seq in seqs:
        last = first_row[seq.request_id] + len(seq.token_ids) - 1
        d = seq.num_draft_tokens
        rows += range(last - d, last + 1)
        if d == 0:
            per_row.append(seq)
            continue
        drafts = seq.token_ids[len(seq.token_ids) - d :]
        min_tokens = seq.params.min_tokens
        for j in range(d + 1):
            output_ids = seq.penalty_output_ids
            per_row.append(
                dataclasses.replace(
                    seq,
                    num_output_tokens=seq.num_output_tokens + j,
                    penalty_output_ids=None if output_ids is None else output_ids + drafts[:j],
                    banned_token_ids=(
                        seq.banned_token_ids if seq.num_output_tokens + j < min_tokens else ()
                    ),
                    grammar_row=None if seq.grammar_row is None else seq.grammar_row + j,
                    num_draft_tokens=0,
                )
            )
    return rows, per_row


def verify(seqs: list[ScheduledSeq], out: StepOutput) -> None:
    """Keep each sequence's drafts up to the first one its row did not sample. ``out`` holds one
    token (and logprobs entry) per row of position_rows, in its order; it is rewritten to hold
    one per sequence, the sampled token after its accepted drafts, with num_accepted_drafts and
    the accepted drafts' logprobs beside."""
    row_tokens, row_logprobs = out.sampled_token_ids, out.sampled_logprobs
    tokens: list[int] = []
    accepted_counts: list[int] = []
    logprobs: list[TokenLogprobs | None] = []
    row = 0
    for seq in seqs:
        d = seq.num_draft_tokens
        drafts = seq.token_ids[len(seq.token_ids) - d :]
        accepted = 0
        while accepted < d and row_tokens[row + accepted] == drafts[accepted]:
            accepted += 1
        tokens.append(row_tokens[row + accepted])
        accepted_counts.append(accepted)
        if row_logprobs is not None:
            logprobs.append(row_logprobs[row + accepted])
            kept = row_logprobs[row : row + accepted]
            if accepted and kept[0] is not None:
                out.draft_logprobs[seq.request_id] = kept  # type: ignore[assignment]
        row += d + 1
    out.sampled_token_ids = tokens
    out.num_accepted_drafts = accepted_counts
    if row_logprobs is not None:
        out.sampled_logprobs = logprobs
