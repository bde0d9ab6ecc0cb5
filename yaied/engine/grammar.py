"""Structured outputs in the engine: the model's grammar compiler, and every step's token mask.

A grammar is per-sequence state, like the page table: the Request holds its matcher
(`Request.grammar`), the scheduler advances it where it appends the sampled token, and each step
the engine writes the allowed next tokens of every constrained row into one persistent bitmask
that the Batch carries to the worker (`ScheduledSeq.grammar_row` says which row), where the
sampler masks the logits before any other knob.

`Grammars`, one per InputProcessor (one per served model in a process), compiles specs. Its
GrammarCompiler is built on the first constrained request, in a thread (xgrammar scans the whole
vocabulary, about half a second), never at start-up: a daemon that serves no structured output
pays nothing. Compiles run on the compiler's own small pool, off the event loop.

`StepMasks`, one per engine, owns the bitmask (allocated on first use for `max_num_seqs` rows,
reallocated only when a step with speculative drafts needs a row per position) and fills it
right before the batch goes to the worker. The engine task and
the worker thread never run at once for one engine, so they share the host buffer safely.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch

from yaied.core.grammar_spec import GrammarSpec, StructuredOutputError
from yaied.core.request import Request
from yaied.core.step import Batch
from yaied.engine.threads import run_torch_serially
from yaied.structured import (
    CompiledGrammar,
    GrammarCompiler,
    SequenceMatcher,
    TokenBitmask,
    allocate_bitmask,
    check_spec,
    fill_bitmasks,
    row_allows_only,
)


class Grammars:
    """Compile-before-admission for one model: the lazily built compiler and its cache."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        # The grammar may end only where the model would: on one of its EOS ids.
        self._stop_token_ids = sorted(stop_token_ids)
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()
        # Told each compile's seconds, in a compile thread (the server's histogram).
        self.on_compile: Callable[[float], None] | None = None

    def _built(self, spec: GrammarSpec) -> GrammarCompiler:
        """The compiler, built on first use (blocking: call it in a thread from the loop)."""
        if self._compiler is None:
            with self._lock:
                if self._compiler is None:
                    if self._tokenizer is None:
                        raise StructuredOutputError(
                            spec.param or "response_format",
                            "this model has no tokenizer: structured outputs need one",
                        )
                    self._compiler = GrammarCompiler(
                        self._tokenizer,
                        self._vocab_size,
                        stop_token_ids=self._stop_token_ids or None,
                        on_compile=self._observe,
                    )
        return self._compiler

    def _observe(self, seconds: float) -> None:
        if self.on_compile is not None:
            self.on_compile(seconds)

    def cached(self, spec: GrammarSpec, *, count: bool = True) -> CompiledGrammar | None:
        """The compiled spec when the cache has it (microseconds), else None."""
        compiler = self._compiler
        return None if compiler is None else compiler.cached(spec, count=count)

    async def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile (or fetch) without blocking the loop; a bad spec, or one past the compile
        timeout, raises StructuredOutputError (a ValueError naming the request field)."""
        compiler = self._compiler or await asyncio.to_thread(self._built_serially, spec)
        return await compiler.compile_async(spec)

    def _built_serially(self, spec: GrammarSpec) -> GrammarCompiler:
        run_torch_serially()  # a live pool thread of the loop's: no OpenMP team (threads.py)
        return self._built(spec)

    async def first_refused(self, specs: Iterable[GrammarSpec]) -> StructuredOutputError | None:
        """The error of the first of ``specs`` that would not compile on its own, else None:
        which part of a spec that did not compile is at fault. Checked without the vocabulary
        (structured.check_spec: a fraction of a compile), off the loop; nothing is cached."""
        return await asyncio.to_thread(_first_refused, list(specs))

    def compile_sync(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile in the calling thread: for callers outside an event loop (LLM, tests)."""
        return self._built(spec).compile(spec)

    def matcher(self, spec: GrammarSpec) -> SequenceMatcher | None:
        """A fresh matcher when the spec is compiled already (the engine's admission path: the
        front end's compile was counted, so this lookup is not)."""
        compiled = self.cached(spec, count=False)
        return None if compiled is None else SequenceMatcher.create(compiled)

    @staticmethod
    def matcher_of(compiled: CompiledGrammar) -> SequenceMatcher:
        return SequenceMatcher.create(compiled)  # microseconds: the grammar is shared

    def stats(self) -> dict[str, int | float] | None:
        """The compile cache's counters, None before the first constrained request."""
        compiler = self._compiler
        if compiler is None:
            return None
        s = compiler.stats
        return {
            "hits": s.hits,
            "misses": s.misses,
            "joined": s.joined,
            "errors": s.errors,
            "timeouts": s.timeouts,
            "evictions": s.evictions,
            "cache_bytes": s.cache_bytes,
            "cache_entries": s.cache_entries,
        }

    def close(self) -> None:
        if self._compiler is not None:
            self._compiler.close()


def _first_refused(specs: list[GrammarSpec]) -> StructuredOutputError | None:
    for spec in specs:
        try:
            check_spec(spec)
        except StructuredOutputError as exc:
            return exc
    return None


class StepMasks:
    """The persistent token bitmask, filled for the constrained rows of each step."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device | str) -> None:
        self._shape = (max_rows, vocab_size, device)
        self._bitmask: TokenBitmask | None = None
        self.seconds = 0.0  # filling here plus applying in the worker (StepOutput.mask_time)
        self.steps = 0  # steps with at least one constrained row

    def fill(self, batch: Batch, requests: dict[str, Request]) -> None:
        """Give each constrained sampling sequence its bitmask row (its logits row: sampled
        sequences in batch order, a sequence with d speculative drafts taking d + 1 rows),
        fill the rows, and attach the bitmask to the batch."""
        seqs, matchers = [], []
        row = 0
        for seq in batch.seqs:
            if not seq.sample:
                continue
            request = requests.get(seq.request_id)
            if request is not None and request.grammar is not None:
                seq.grammar_row = row
                seqs.append(seq)
                matchers.append(cast(SequenceMatcher, request.grammar))
            row += 1 + seq.num_draft_tokens
        if not seqs:
            return
        start = time.perf_counter()
        max_rows, vocab_size, device = self._shape
        if self._bitmask is None or self._bitmask.max_rows < row:
            self._bitmask = allocate_bitmask(max(max_rows, row), vocab_size, device)
        bitmask = self._bitmask
        plain = [(m, s) for m, s in zip(matchers, seqs, strict=True) if not s.num_draft_tokens]
        fill_bitmasks([m for m, _ in plain], bitmask, [s.grammar_row for _, s in plain])
        for matcher, seq in zip(matchers, seqs, strict=True):
            if seq.num_draft_tokens:
                drafts = seq.token_ids[len(seq.token_ids) - seq.num_draft_tokens :]
                matcher.fill_bitmask_rows(bitmask, seq.grammar_row, drafts)
        for seq in seqs:
            # min_tokens bans EOS; where the grammar allows nothing else (it is complete), the
            # grammar wins: a row with every token banned could sample nothing.
            if seq.banned_token_ids and row_allows_only(
                bitmask, seq.grammar_row, seq.banned_token_ids
            ):
                seq.banned_token_ids = ()
        batch.grammar_bitmask = bitmask
        self.seconds += time.perf_counter() - start
        self.steps += 1
