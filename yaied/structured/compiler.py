"""Grammar compilation: one `GrammarCompiler` per model, a byte-bounded cache, off-loop compiles.

xgrammar compiles a spec into a grammar plus a per-state token-mask cache over the model's
vocabulary; that is the expensive part (milliseconds for a small schema, a second or more for a
large one) and it is what the cache keeps. xgrammar's own cache is disabled: this one is keyed by
the canonical spec, so it also dedups concurrent compiles and counts hits and misses.

Threads: compiles run on a small ThreadPoolExecutor (xgrammar releases the GIL while it compiles),
so the event loop never blocks and a slow compile holds at most one of `max_workers` seats.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

from yaied.core.grammar_spec import GrammarSpec, StructuredOutputError
from yaied.structured.backend import xgrammar
from yaied.structured.schema_prepare import prepare_schema_source, prepare_structural_tag_source
from yaied.structured.tokenizer import build_tokenizer_info

if TYPE_CHECKING:
    import xgrammar as xgr

logger = logging.getLogger(__name__)

DEFAULT_CACHE_LIMIT_BYTES = 256 * 1024 * 1024
# What a cached grammar holds, from xgrammar's `memory_size_bytes` (S): 3/2 S + 4 KiB. xgrammar
# counts each container's size(), not its capacity, and none of malloc's chunk headers or node
# overheads, so the heap an entry holds is more than S. glibc's in-use bytes (mallinfo2) per held
# entry over S, 60 distinct specs of a kind each, smollm2-135m's 49152-token vocabulary, xgrammar
# 0.2.9 (2026-11-29): JSON schemas of 1, 3, 10 and 30 properties 1.13, 1.21, 1.26 and 1.28 (S 32
# to 275 KB), 30 with patterns and bounded arrays 1.47 (S 594 KB), regexes 1.22, choices 1.47,
# small EBNF 1.51 (S 5 KB); 90-100% of it comes back on clear_cache. With the cache full and
# evicting, in-use stays at 1.47x the accounted bytes and RSS levels off: nothing leaks per
# compile. tests/structured/test_compiler.py checks that the accounting covers the heap held.
_HELD_PER_COUNTED_BYTE = 1.5
_HELD_PER_ENTRY = 4096
DEFAULT_COMPILE_TIMEOUT_S = 10.0
# Two seats: a pathological spec occupies one, everything else still compiles on the other,
# and at most two cores go to compiling while the model runs.
DEFAULT_MAX_WORKERS = 2
# xgrammar's own threads inside one compile (it splits the vocabulary scan).
DEFAULT_THREADS_PER_COMPILE = 2

# xgrammar prefixes errors with a timestamp and its C++ source location; clients get the reason.
_LOG_PREFIX = re.compile(r"\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")
_MAX_REASON_CHARS = 500


@dataclass(frozen=True, slots=True)
class CompiledGrammar:
    """A compiled spec, shared read-only by every matcher built from it."""

    spec: GrammarSpec
    grammar: xgr.CompiledGrammar
    memory_bytes: int  # what it holds in the cache: xgrammar's size, scaled, plus the key
    compile_seconds: float


@dataclass(slots=True)
class CompileStats:
    """Counters for /metrics. `on_compile` (the compiler's hook) sees each compile's seconds."""

    hits: int = 0  # found in the cache
    misses: int = 0  # started a compile
    joined: int = 0  # waited for a compile another request had started
    errors: int = 0  # invalid specs
    timeouts: int = 0  # waiters that gave up
    evictions: int = 0
    compiles: int = 0
    compile_seconds_total: float = 0.0
    cache_bytes: int = 0
    cache_entries: int = 0


@dataclass(slots=True)
class _Inflight:
    future: concurrent.futures.Future[CompiledGrammar]
    waiters: int = 0


def _choice_ebnf(source: str) -> str:
    # JSON string escapes (\" \\ \n \uXXXX) are also xgrammar EBNF literal escapes.
    choices = json.loads(source)
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCompiler:
    """Compiles `GrammarSpec`s for one model; thread-safe, one instance per tokenizer.

    `max_json_whitespace` bounds JSON whitespace: 0 (the default) writes JSON on one line with
    json.dumps' separators (", " and ": ") and no other whitespace, so ``json_object`` cannot
    loop on whitespace; n > 0 allows up to n whitespace characters between tokens of the JSON.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        *,
        stop_token_ids: Sequence[int] | None = None,
        tokenizer_info: xgr.TokenizerInfo | None = None,
        cache_limit_bytes: int = DEFAULT_CACHE_LIMIT_BYTES,
        max_workers: int = DEFAULT_MAX_WORKERS,
        threads_per_compile: int = DEFAULT_THREADS_PER_COMPILE,
        timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
        max_json_whitespace: int = 0,
        on_compile: Callable[[float], None] | None = None,
    ) -> None:
        # Building the tokenizer info scans the vocabulary (~0.5 s); pass one to share it.
        if tokenizer_info is None:
            tokenizer_info = build_tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        self.tokenizer_info = tokenizer_info
        self.vocab_size = vocab_size
        self.cache_limit_bytes = cache_limit_bytes
        self.timeout_s = timeout_s
        self.on_compile = on_compile
        self.stats = CompileStats()
        if max_json_whitespace > 0:
            self._json_options: dict[str, Any] = {"max_whitespace_cnt": max_json_whitespace}
        else:
            self._json_options = {"any_whitespace": False}
        self._xgr = xgrammar().GrammarCompiler(
            self.tokenizer_info, max_threads=threads_per_compile, cache_enabled=False
        )
        # One torch thread each: a live thread that runs a parallel torch op keeps an OpenMP team,
        # and more OpenMP threads than CPUs slow every engine step (yaied/engine/threads.py).
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_workers,
            thread_name_prefix="yaied-grammar",
            initializer=torch.set_num_threads,
            initargs=(1,),
        )
        # Guards _cache, _inflight and stats: the loop thread, pool threads and sync callers
        # all touch them; every critical section is a few dict operations.
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._inflight: dict[str, _Inflight] = {}

    @property
    def stop_token_ids(self) -> list[int]:
        return list(self.tokenizer_info.stop_token_ids)

    def cached(self, spec: GrammarSpec, *, count: bool = True) -> CompiledGrammar | None:
        """The compiled spec if it is in the cache (a hit), else None; never compiles.
        ``count=False`` leaves the hit out of the stats: a second lookup for a request whose
        compile was counted already (the engine's, after the server's)."""
        with self._lock:
            return self._lookup(spec.key, count)

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile (or fetch) `spec`, blocking the caller; no timeout. For tests and offline use."""
        with self._lock:
            hit = self._lookup(spec.key)
            if hit is not None:
                return hit
            entry = self._start(spec)
            entry.waiters += 1  # so that an async waiter giving up does not cancel it under us
        try:
            return entry.future.result()
        except StructuredOutputError as e:
            raise StructuredOutputError(spec.param or e.param, e.message) from None
        finally:
            with self._lock:
                entry.waiters -= 1

    async def compile_async(
        self, spec: GrammarSpec, timeout_s: float | None = None
    ) -> CompiledGrammar:
        """Compile (or fetch) `spec` without blocking the loop.

        A cache hit returns at once. Concurrent calls for one spec share one compile. Past the
        timeout (queueing included) this raises `StructuredOutputError`; the compile itself
        cannot be interrupted, so it finishes in the background and lands in the cache, unless
        no one waits for it any more and it has not started, in which case it is dropped.
        """
        timeout = self.timeout_s if timeout_s is None else timeout_s
        with self._lock:
            hit = self._lookup(spec.key)
            if hit is not None:
                return hit
            entry = self._start(spec)
            entry.waiters += 1
        try:
            # shield: a timed-out or cancelled waiter must not cancel a compile others share.
            shared = asyncio.wrap_future(entry.future)
            # Once every waiter has gone, nobody reads the outcome: mark it read so asyncio does
            # not log "exception was never retrieved" for a failed compile.
            shared.add_done_callback(lambda f: f.cancelled() or f.exception())
            return await asyncio.wait_for(asyncio.shield(shared), timeout)
        except TimeoutError:
            with self._lock:
                self.stats.timeouts += 1
            raise StructuredOutputError(
                spec.param, f"compiling the constraint took longer than {timeout:g} s"
            ) from None
        except StructuredOutputError as e:
            raise StructuredOutputError(spec.param or e.param, e.message) from None
        finally:
            with self._lock:
                entry.waiters -= 1
                # Still queued and nobody wants it: drop it so it never takes a seat.
                if (
                    entry.waiters == 0
                    and entry.future.cancel()
                    and self._inflight.get(spec.key) is entry
                ):
                    del self._inflight[spec.key]

    def clear_cache(self) -> None:
        with self._lock:
            self._cache.clear()
            self.stats.cache_bytes = 0
            self.stats.cache_entries = 0

    def close(self) -> None:
        """Stop the pool; queued compiles are cancelled, a running one finishes."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- internals; `_lookup`, `_start` and `_store` run under self._lock --

    def _lookup(self, key: str, count: bool = True) -> CompiledGrammar | None:
        compiled = self._cache.get(key)
        if compiled is not None:
            self._cache.move_to_end(key)
            self.stats.hits += count
        return compiled

    def _start(self, spec: GrammarSpec) -> _Inflight:
        entry = self._inflight.get(spec.key)
        if entry is not None:
            self.stats.joined += 1
            return entry
        self.stats.misses += 1
        entry = _Inflight(self._pool.submit(self._run, spec))
        self._inflight[spec.key] = entry
        return entry

    def _run(self, spec: GrammarSpec) -> CompiledGrammar:
        """Pool thread: compile, then publish to the cache and retire the in-flight entry in one
        critical section, so a caller always finds one or the other and never compiles twice."""
        compiled: CompiledGrammar | None = None
        try:
            compiled = self._compile_uncached(spec)
            return compiled
        finally:
            with self._lock:
                self._inflight.pop(spec.key, None)
                if compiled is None:
                    self.stats.errors += 1
                else:
                    self.stats.compiles += 1
                    self.stats.compile_seconds_total += compiled.compile_seconds
                    self._store(compiled)
            if compiled is not None and self.on_compile is not None:
                try:
                    self.on_compile(compiled.compile_seconds)
                except Exception:  # a metrics hook must never fail a compile
                    logger.exception("structured outputs: the on_compile hook raised")

    def _store(self, compiled: CompiledGrammar) -> None:
        if compiled.memory_bytes > self.cache_limit_bytes:
            return  # larger than the whole cache: served to its waiters, never kept
        key = compiled.spec.key
        self._cache[key] = compiled
        self.stats.cache_bytes += compiled.memory_bytes
        while self.stats.cache_bytes > self.cache_limit_bytes:
            _, evicted = self._cache.popitem(last=False)
            self.stats.cache_bytes -= evicted.memory_bytes
            self.stats.evictions += 1
        self.stats.cache_entries = len(self._cache)

    def _compile_uncached(self, spec: GrammarSpec) -> CompiledGrammar:
        start = time.perf_counter()
        try:
            grammar = self._xgr_compile(spec)
        except StructuredOutputError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError (and a few others) for bad specs
            raise StructuredOutputError(spec.param, _reason(spec, e)) from None
        seconds = time.perf_counter() - start
        measured = int(getattr(grammar, "memory_size_bytes", 0))
        if measured:
            size = int(measured * _HELD_PER_COUNTED_BYTE) + _HELD_PER_ENTRY
        else:
            size = 64 * len(spec.source) + 4096
        size += len(spec.key.encode("utf-8", "surrogatepass"))
        return CompiledGrammar(spec, grammar, size, seconds)

    def _xgr_compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        return _convert(self._xgr, spec, self._json_options)


def _grammar_only() -> SimpleNamespace:
    """GrammarCompiler's methods without the vocabulary: xgrammar's Grammar constructors, which
    refuse what a compile refuses (the same converters) in a fraction of its time."""
    grammar = xgrammar().Grammar
    return SimpleNamespace(
        compile_json_schema=grammar.from_json_schema,
        compile_regex=grammar.from_regex,
        compile_grammar=grammar.from_ebnf,
        compile_structural_tag=grammar.from_structural_tag,
    )


def check_spec(spec: GrammarSpec) -> None:
    """Raise StructuredOutputError (``spec.param``, the reason) when `spec` would not compile;
    nothing is compiled against a vocabulary, nothing cached. To find which part of a larger
    spec that did not compile is at fault (one tool's schema among a request's tools)."""
    try:
        _convert(_grammar_only(), spec, {"any_whitespace": False})
    except Exception as e:
        raise StructuredOutputError(spec.param, _reason(spec, e)) from None


def _convert(builder: Any, spec: GrammarSpec, json_options: dict[str, Any]) -> Any:
    """`spec` through `builder`'s compile_* methods (xgrammar's GrammarCompiler, or
    _grammar_only's), each schema prepared first (schema_prepare.py)."""
    if spec.kind == "json_schema":
        source = prepare_schema_source(spec.source)
        try:
            return builder.compile_json_schema(source, **json_options)
        except RuntimeError as strict_error:
            # strict_mode (xgrammar's default: no properties the schema does not name) makes
            # some valid schemas unsatisfiable, e.g. minProperties above the named ones.
            # Retry those without it; if that fails too, the strict error is reported.
            if "additional properties" not in str(strict_error):
                raise
            try:
                return builder.compile_json_schema(source, strict_mode=False, **json_options)
            except RuntimeError:
                raise strict_error from None
    if spec.kind == "json_object":
        return builder.compile_json_schema('{"type":"object"}', **json_options)
    if spec.kind == "regex":
        return builder.compile_regex(spec.source)
    if spec.kind == "choice":
        return builder.compile_grammar(_choice_ebnf(spec.source))
    if spec.kind == "structural_tag":
        return builder.compile_structural_tag(prepare_structural_tag_source(spec.source))
    return builder.compile_grammar(spec.source)


def _reason(spec: GrammarSpec, error: Exception) -> str:
    what = {
        "json_schema": "invalid JSON schema",
        "json_object": "invalid JSON object grammar",
        "regex": "invalid regular expression",
        "choice": "invalid choice",
        "grammar": "invalid grammar",
        "structural_tag": "invalid structural tag",
    }[spec.kind]
    text = _LOG_PREFIX.sub("", str(error)).strip() or type(error).__name__
    if len(text) > _MAX_REASON_CHARS:
        text = text[:_MAX_REASON_CHARS] + "..."
    return f"{what}: {text}"
