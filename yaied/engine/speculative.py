"""N-gram (prompt-lookup) drafting for speculative decoding.

At batch 1 a decode step is bound by reading the weights, and agents' outputs (code edits, JSON
copied with changes, tool calls quoting the prompt) repeat their context. So before a decode the
scheduler guesses the next few tokens: it finds the longest suffix of the request's tokens (at
most ``prompt_lookup_max``, at least ``prompt_lookup_min`` tokens) that occurred before, in the
prompt or the output, and proposes the tokens that followed its most recent occurrence. The
guesses ride along in the decode's chunk (``ScheduledSeq.num_draft_tokens``), so one forward pass
through the extend path scores every position; the worker (``yaied/worker/speculative.py``)
keeps the drafts up to the first one the model disagrees with, plus the model's own next token.

No model, no tensors: plain Python over the request's token ids. The search runs in C through
``bytes.rfind`` over the ids packed as int32, a few microseconds for thousands of tokens.

Drafting stays out of the way where it cannot help: never past ``max_tokens`` or the context,
never more than the step's token budget, never a token the request's grammar refuses (drafts are
cut there), and not at all in a step with more running requests than
``speculative_max_batch_size``, where verifying costs more compute than it saves weight reads.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from yaied.core.config import SpeculativeConfig
from yaied.core.request import Request

_ID = array("i")
assert _ID.itemsize == 4  # token ids packed as int32 for the byte search


@dataclass(slots=True)
class SpecCounters:
    """What the engine reports, named as vLLM's spec_decode_* counters."""

    num_drafts: int = 0  # sequence-steps that carried drafts
    num_draft_tokens: int = 0  # draft tokens verified
    num_accepted_tokens: int = 0  # of those, the ones the model agreed with

    def count(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted

    def stats(self) -> dict[str, int]:
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
        }


class NgramProposer:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len

    def active(self, num_running: int) -> bool:
        """Whether a step with this many running requests speculates at all."""
        limit = self.config.speculative_max_batch_size
        return limit == 0 or num_running <= limit

    def drafts(self, request: Request, budget: int) -> list[int]:
        """Up to num_speculative_tokens guesses of the tokens after a decoding request's last
        one, for a step with ``budget`` tokens left (the last token itself takes one)."""
        params = request.params
        limit = min(
            self.config.num_speculative_tokens,
            budget - 1,
            # Each accepted draft is an output token, and the model adds one more after them.
            params.max_tokens - len(request.output_token_ids) - 1,
            self.max_model_len - request.num_tokens - 1,
        )
        if limit <= 0:
            return []
        if request.grammar is not None and len(request.output_token_ids) < params.min_tokens:
            return []  # the grammar may lift the min_tokens ban row by row: not worth drafting
        found = ngram_drafts(
            request.all_token_ids,
            limit,
            self.config.prompt_lookup_min,
            self.config.prompt_lookup_max,
        )
        if found and request.grammar is not None:
            found = found[: request.grammar.num_acceptable(found)]
        return found


def ngram_drafts(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The (up to) k tokens that followed the most recent earlier occurrence of the longest
    suffix of ``tokens`` of min_n..max_n tokens; [] when no such suffix occurred before."""
    length = len(tokens)
    if k <= 0 or length <= min_n:
        return []
    data = array("i", tokens).tobytes()
    # The occurrence must end before the last token, so that at least one token follows it.
    end = (length - 1) * 4
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = data[(length - n) * 4 :]
        pos = data.rfind(pattern, 0, end)
        while pos > 0 and pos % 4:  # a match across token boundaries: look further back
            pos = data.rfind(pattern, 0, pos + len(pattern) - 1)
        if pos >= 0 and pos % 4 == 0:
            start = pos // 4 + n
            return tokens[start : start + k]
    return []
