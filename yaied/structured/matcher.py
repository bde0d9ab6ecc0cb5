"""Decoding under a grammar: one `SequenceMatcher` per constrained sequence, one token bitmask.

Per step, for the rows that sample a constrained sequence:

1. each matcher fills its row of the persistent bitmask (`fill_bitmask`/`fill_bitmasks`, on the
   CPU; xgrammar's matcher only writes host memory);
2. `apply_bitmask(logits, bitmask, rows)` sets every token the grammar forbids to -inf in those
   rows, before any other logits processing, so penalties, temperature and top-p only ever see
   allowed tokens; unconstrained rows are not touched;
3. the sampled token goes to `accept` where it is appended to the sequence.

Row contract: bitmask row r belongs to logits row r. The bitmask is sized for the largest batch
once and reused; filling a row overwrites it completely, so stale rows need no clearing.

Preemption by recompute keeps the request's output tokens, and the matcher has accepted exactly
those tokens, so its state stays valid: nothing is rolled back or replayed. `reset` plus
`accept_tokens(output_ids)` rebuilds a matcher from scratch where one is lost (e.g. a request
moved to another engine); `rollback` undoes accepted tokens (speculative decoding).

A matcher never raises into the step: a token the grammar refuses, or an xgrammar error, makes
`accept` return False and records `error`, and the caller fails that request alone. A failed or
terminated matcher fills a row that allows only the stop tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from yaied.structured.backend import xgrammar
from yaied.structured.compiler import CompiledGrammar

if TYPE_CHECKING:
    import xgrammar as xgr

# Dtypes xgrammar's CPU and CUDA kernels take; anything else goes through the torch fallback.
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(slots=True)
class TokenBitmask:
    """The persistent bitmask: bit t of row r set means token t is allowed in logits row r."""

    host: torch.Tensor  # int32 [max_rows, ceil(vocab_size / 32)] on the CPU, where matchers write
    device_copy: torch.Tensor | None  # the same shape on the logits' device, when not the CPU
    vocab_size: int

    @property
    def max_rows(self) -> int:
        return self.host.shape[0]


def allocate_bitmask(
    max_rows: int, vocab_size: int, device: torch.device | str = "cpu"
) -> TokenBitmask:
    """Allocate once per worker: `max_rows` is the largest batch that samples, `vocab_size` the
    model's logits width (padded rows included). On CUDA the host side is pinned so that the
    per-step copy is asynchronous."""
    device = torch.device(device)
    # All ones (every token allowed), filled by numpy: torch's fill of this many words is a
    # parallel op, and on the event loop's thread it would start an OpenMP team that slows every
    # later engine step (yaied/engine/threads.py). The same layout as xgr.allocate_token_bitmask.
    words = (vocab_size + 31) // 32
    host = torch.from_numpy(np.full((max_rows, words), -1, dtype=np.int32))
    device_copy = None
    if device.type != "cpu":
        if device.type == "cuda":
            host = host.pin_memory()
        device_copy = torch.empty_like(host, device=device)
    return TokenBitmask(host, device_copy, vocab_size)


def apply_bitmask(
    logits: torch.Tensor,
    bitmask: TokenBitmask,
    rows: Sequence[int],
    cpu_kernel: Callable[[torch.Tensor, torch.Tensor, list[int], int], bool] | None = None,
) -> None:
    """In place: in each logits row listed in `rows`, set the tokens that bitmask row forbids to
    -inf. Columns past the bitmask's vocabulary (never valid tokens) are set to -inf too.
    `cpu_kernel` (the worker's CpuFusedOps.apply_token_bitmask) masks CPU logits in place of
    xgrammar's kernel, which is several times slower there; it returns False for what it does
    not take."""
    if not rows:
        return
    rows = list(rows)
    mask = bitmask.host
    vocab = min(logits.shape[-1], bitmask.vocab_size)
    if (
        cpu_kernel is not None
        and logits.device.type == "cpu"
        and cpu_kernel(logits, mask, rows, vocab)
    ):
        _ban_past(logits, bitmask, rows)
        return
    if logits.device.type != "cpu":
        if bitmask.device_copy is None or bitmask.device_copy.device != logits.device:
            raise ValueError(f"the bitmask was not allocated for {logits.device}")
        used = max(rows) + 1
        # The host rows are rewritten only after this step's sampled ids came back to the host,
        # which waits for this copy, so the non-blocking copy never reads a half-filled row.
        bitmask.device_copy[:used].copy_(bitmask.host[:used], non_blocking=True)
        mask = bitmask.device_copy
    if logits.dtype in _KERNEL_DTYPES and logits.device.type in ("cpu", "cuda"):
        xgrammar().apply_token_bitmask_inplace(logits, mask, vocab_size=vocab, indices=rows)
    else:
        _apply_torch(logits, mask, rows, vocab)
    _ban_past(logits, bitmask, rows)


def _ban_past(logits: torch.Tensor, bitmask: TokenBitmask, rows: list[int]) -> None:
    """Columns past the bitmask's vocabulary (padding of the LM head): never valid tokens."""
    if logits.shape[-1] > bitmask.vocab_size:
        index = torch.tensor(rows, device=logits.device)
        logits[index, bitmask.vocab_size :] = float("-inf")


def _apply_torch(logits: torch.Tensor, mask: torch.Tensor, rows: list[int], vocab: int) -> None:
    # Unpacks every bit: correct on any device and dtype, far slower than xgrammar's kernels.
    index = torch.tensor(rows, device=logits.device)
    shifts = torch.arange(32, device=mask.device, dtype=torch.int32)
    bits = (mask.index_select(0, index.to(mask.device)).unsqueeze(-1) >> shifts) & 1
    banned = (bits.reshape(len(rows), -1)[:, :vocab] == 0).to(logits.device)
    sub = logits.index_select(0, index)
    sub[:, :vocab].masked_fill_(banned, float("-inf"))
    logits.index_copy_(0, index, sub)


def row_allows_only(bitmask: TokenBitmask, row: int, token_ids: Sequence[int]) -> bool:
    """Whether `row` allows no token outside `token_ids`: banning those too (min_tokens bans
    EOS) would leave the row nothing to sample, so the caller lifts the ban instead."""
    words = bitmask.host[row].clone()
    for token in token_ids:
        word, bit = divmod(token, 32)
        if word < words.shape[0]:
            value = int(words[word]) & ~(1 << bit) & 0xFFFFFFFF
            words[word] = value - (1 << 32) if value >= 1 << 31 else value  # int32 two's complement
    return not bool(words.any())


def _stop_only_row(row: torch.Tensor, stop_token_ids: Sequence[int]) -> None:
    row.zero_()
    for token in stop_token_ids:
        word, bit = divmod(token, 32)
        if word < row.shape[0]:
            value = int(row[word]) | (1 << bit)
            row[word] = value - (1 << 32) if value >= 1 << 31 else value  # int32 two's complement


@dataclass(slots=True)
class SequenceMatcher:
    """The grammar state of one sequence (one per choice when n > 1)."""

    compiled: CompiledGrammar
    matcher: xgr.GrammarMatcher = field(repr=False)
    error: str | None = None  # why the sequence left the grammar; the caller fails the request
    num_accepted: int = 0

    @classmethod
    def create(cls, compiled: CompiledGrammar) -> SequenceMatcher:
        # Microseconds: the compiled grammar is shared, the matcher holds only the parse state.
        return cls(compiled, xgrammar().GrammarMatcher(compiled.grammar))

    @property
    def failed(self) -> bool:
        return self.error is not None

    @property
    def is_terminated(self) -> bool:
        """True once a stop token was accepted where the grammar may end: the sequence ends
        with finish_reason ``stop``."""
        return self.matcher.is_terminated()

    @property
    def is_completed(self) -> bool:
        """True when the grammar may end here (only a stop token, if anything, can follow)."""
        return self.matcher.is_completed()

    @property
    def stop_token_ids(self) -> list[int]:
        return list(self.matcher.stop_token_ids)

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token. False (with `error` set) if the grammar refuses it; the
        matcher state is then unchanged and the request should end with an error."""
        if self.error is not None:
            return False
        try:
            terminated = self.matcher.is_terminated()
            ok = not terminated and self.matcher.accept_token(int(token_id))
        except Exception as e:  # xgrammar raising is a bug there; it must not end the batch
            self.error = f"the grammar matcher failed on token {token_id}: {e}"
            return False
        if not ok:
            where = "after the grammar terminated" if terminated else "by the grammar"
            self.error = (
                f"token {token_id} at output position {self.num_accepted} is not allowed {where}"
            )
            return False
        self.num_accepted += 1
        return True

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        """Replay tokens (a rebuilt matcher); stops at the first refused one."""
        return all(self.accept(token) for token in token_ids)

    def fill_bitmask(self, bitmask: TokenBitmask | torch.Tensor, row: int) -> bool:
        """Write this sequence's allowed next tokens into `row` of the host bitmask. Returns
        False when the row allows every token (xgrammar's hint): the caller may leave that row
        out of `apply_bitmask`."""
        host = bitmask.host if isinstance(bitmask, TokenBitmask) else bitmask
        if self.error is None and not self.matcher.is_terminated():
            try:
                return bool(self.matcher.fill_next_token_bitmask(host, row))
            except Exception as e:
                self.error = f"the grammar matcher failed to compute the next tokens: {e}"
        _stop_only_row(host[row], self.stop_token_ids)
        return True

    def fill_bitmask_rows(self, bitmask: TokenBitmask, row: int, drafts: Sequence[int]) -> None:
        """Fill `row` as fill_bitmask does, then rows row + 1, row + 2... as they stand after
        each draft token in turn (speculative decoding verifies every position at once). The
        drafts were checked with num_acceptable; the state is left as it was."""
        self.fill_bitmask(bitmask, row)
        count = 0
        for token in drafts:
            if self.error is not None or not self.matcher.accept_token(int(token)):
                break
            count += 1
            self.fill_bitmask(bitmask, row + count)
        if count:
            self.matcher.rollback(count)

    def num_acceptable(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of `token_ids` the grammar would accept from here (speculative
        drafts are cut at the first refused one). The state is left as it was, error included."""
        if self.error is not None:
            return 0
        count = 0
        try:
            for token in token_ids:
                if self.matcher.is_terminated() or not self.matcher.accept_token(int(token)):
                    break
                count += 1
        except Exception:  # refusing a draft must never fail the request
            pass
        if count:
            self.matcher.rollback(count)
        return count

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        if num_tokens > 0:
            self.matcher.rollback(num_tokens)
            self.num_accepted -= num_tokens

    def reset(self) -> None:
        """Back to the grammar's start, clearing any error."""
        self.matcher.reset()
        self.error = None
        self.num_accepted = 0


def fill_bitmasks(
    matchers: Sequence[SequenceMatcher],
    bitmask: TokenBitmask,
    rows: Sequence[int],
    batch: xgr.BatchGrammarMatcher | None = None,
) -> None:
    """Fill `rows[i]` from `matchers[i]` for a whole step. With `batch` (an
    `xgrammar.BatchGrammarMatcher`, built once per worker) the live matchers are filled by
    xgrammar's threads in one call without the GIL; otherwise one by one."""
    if batch is None or len(matchers) < 2:
        for matcher, row in zip(matchers, rows, strict=True):
            matcher.fill_bitmask(bitmask, row)
        return
    live: list[xgr.GrammarMatcher] = []
    live_rows: list[int] = []
    for matcher, row in zip(matchers, rows, strict=True):
        if matcher.error is None and not matcher.matcher.is_terminated():
            live.append(matcher.matcher)
            live_rows.append(row)
        else:
            matcher.fill_bitmask(bitmask, row)
    if not live:
        return
    try:
        batch.batch_fill_next_token_bitmask(live, bitmask.host, live_rows)
    except Exception:
        # Find the matcher that failed: the one-by-one path records the error on it alone.
        for matcher, row in zip(matchers, rows, strict=True):
            matcher.fill_bitmask(bitmask, row)
