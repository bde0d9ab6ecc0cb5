"""A stateful fuzzer over the real engine (issue 14), shared by tests/engine/test_engine_fuzz.py
(a derandomized profile in CI) and scripts/fuzz_engine.py (fresh seeds for as long as asked).

A hypothesis ``RuleBasedStateMachine`` drives one ``AsyncEngine`` synchronously, the way
tests/engine/test_fault_levels.py does: ``add_request`` queues, ``abort`` aborts, ``step`` runs
one schedule/execute/update. The model is the tiny random-weight Llama of tests/conftest.py
(fp32) with a byte-level tokenizer of its 256 ids written next to it, so text, UTF-8 hold-back
and stop strings are real. The KV pool is small (``FuzzSetup.num_pages`` pages of 16 tokens,
512 bytes per token in fp32), so requests are preempted; the step budget is small, so prompts
of several pages are chunked.

Rules interleave submissions of every request kind (prompts built from a few shared segments,
so they share and nest prefixes; follow-ups that extend an earlier prompt with its output;
greedy, seeded and unseeded sampling with top-k/top-p/min-p; penalties and logit bias; ``n`` > 1
as the server fans it out, one request per choice, choice k seeded with seed + k; stop token ids
and stop strings, picked from the request's own output when it is deterministic so that they
hit; ``min_tokens``; ``ignore_eos``; ``skip_special_tokens``; logprobs and prompt logprobs;
``max_tokens`` 0 as the server runs it for echo scoring: one token with prompt logprobs, the
token dropped), aborts of queued, waiting, running and finished requests and of whole ``n``
calls, invalid submissions, and engine steps. Stop strings need a tokenizer and the tiny model
has none: hence the byte tokenizer (``write_byte_tokenizer``).

After every engine step: ``check_invariants`` of the engine, and the fuzzer's own, stricter
ones: every page id is exactly one of free, cached in the tree, or owned by one running request;
the tree is well formed, its lock counts are the running requests' locks, and each running
request's shared pages are the tree's pages of its own tokens; nothing is stuck (an idle engine
with open streams, or no progress for ``STALL_STEPS`` steps); every stream ends exactly once
(nothing after its final event; an abort ends it at the next step with ``abort``; never
``error``); finish and stop reasons, token counts, logprob shapes and text agree with the
tokens; the engine never rebuilt its bookkeeping and never died. When a request ends:

- deterministic requests (greedy, or seeded) must equal the same request run alone on a second
  engine (same weights; no prefix cache, no chunking, one request at a time), or, for greedy
  ones without penalties or logit bias, first differ at a step where the alone run's top-2 gap
  is under ``NEAR_TIE`` (random weights have near ties; logprob gap = logit gap);
- every sampled logprob must equal, within ``TOL``, the prompt logprob of the same token when
  the request's prompt plus output is scored alone (teacher forcing), and prompt logprobs must
  equal those of the prompt scored alone.

Seeded requests, and greedy ones with penalties or bias, are compared strictly: the batch
changes logits by ~1e-6, so a flip needs two candidates that close, about one in a million
tokens; such a failure names its step, for a look at the alone run's logprobs.

Each example starts from an empty prefix cache (unless ``carry_cache``) and a reseeded sampler,
so that a failing example replays exactly and hypothesis can shrink it; the engine itself is
built once and kept across examples (it is rebuilt only after a failure).
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections import Counter, OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    invariant,
    multiple,
    rule,
    run_state_machine_as_test,
)

from yaied.core.config import load_config
from yaied.core.request import (
    FinishReason,
    RequestStatus,
    SamplingParams,
    TokenEvent,
    TokenLogprobs,
)
from yaied.core.stream import EventStream
from yaied.engine.async_engine import AsyncEngine
from yaied.engine.faults import check_invariants
from yaied.engine.output import RequestStream

PAGE_SIZE = 16  # the engine's default; the engine under test may use another (FuzzSetup)
# The "llama" tiny config: 2 layers x 2 kv heads x 16 head_dim x 4 bytes (fp32) x 2 (K and V).
BYTES_PER_TOKEN = 2 * 2 * 16 * 4 * 2
TOL = 1e-4  # logprobs of the same token under the same context agree this closely (fp32),
REL_TOL = 5e-5  # plus this share of their size (a prefix hit's chunks sum in another order)
NEAR_TIE = 1e-4  # a greedy run may follow either token of a top-2 gap below this
TOP = 5  # top-N logprobs the oracle asks for (at least any N the fuzzer asks for)
STALL_STEPS = 200  # engine steps without any stream event or new computed token: a livelock
DRAIN_STEPS = 3000  # steps to finish everything at the end of an example
EOS = 2  # the tiny config's eos_token_id (and 1 its bos), special in the byte tokenizer

# Prompts are runs of these segments (then a few loose tokens), so that they share prefixes of
# whole pages (16, 32), of a page and a bit (17, 40) and of less than a page.
SEGMENT_LENGTHS = (16, 5, 17, 1, 32, 40, 15)
_rng = random.Random(14)
SEGMENTS = tuple(tuple(_rng.randrange(256) for _ in range(n)) for n in SEGMENT_LENGTHS)
# Stop strings for requests whose output cannot be known in advance (unseeded sampling).
LOOSE_STOPS = ("e", " ", "\n", "é", "Ā", "ab")


@dataclass(frozen=True)
class FuzzSetup:
    num_pages: int = 16  # 256 tokens: six running requests of a few pages each preempt
    max_model_len: int = 192  # one request's context: 12 pages, so it always fits alone
    max_num_batched_tokens: int = 32  # prompts of more than two pages take several steps
    max_num_seqs: int = 6
    page_size: int = PAGE_SIZE
    policy: str = "fcfs"
    attention_backend: str = "auto"  # triton runs in Triton's interpreter on CPU: ~500x slower
    max_open: int = 12  # a submission first steps the engine until fewer streams are open
    carry_cache: bool = False  # keep the prefix cache across examples (replays less exactly)
    num_speculative_tokens: int = 0  # > 0: n-gram speculative decoding on, every step

    @property
    def kv_cache_gib(self) -> float:
        return self.num_pages * self.page_size * BYTES_PER_TOKEN / 2**30


# -- the model folder -----------------------------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: one printable character per byte."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    bs += range(ord("®"), ord("ÿ") + 1)
    cs = list(bs)
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def write_byte_tokenizer(folder: Path) -> None:
    """A byte-level BPE tokenizer with no merges: id i is byte i, like the model's 256 ids. BOS (1)
    and EOS (2) are special, so decoding with skip_special_tokens drops them."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    chars = _bytes_to_unicode()
    backend = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=chars[1], eos_token=chars[EOS]
    )
    tokenizer.save_pretrained(folder)


def build_model_folder(root: Path, std: float = 0.3) -> Path:
    """The tiny "llama" of tests/conftest.py (seed 0), with the byte tokenizer. A smaller std
    makes a model whose greedy output loops (speculative drafts get accepted)."""
    from tests.conftest import make_tiny_model

    folder = make_tiny_model("llama", root / "llama-bytes", std=std)
    write_byte_tokenizer(folder)
    return folder


# -- the oracle: one request alone on a second engine ---------------------------------------------


@dataclass
class AloneRun:
    tokens: list[int]
    text: str
    finish_reason: FinishReason
    stop_reason: str | int | None
    logprobs: list[TokenLogprobs]
    prompt_logprobs: list[TokenLogprobs | None] | None


class Oracle:
    """Runs requests one at a time on an engine without prefix cache or chunking; memoized."""

    def __init__(self, engine: AsyncEngine, max_entries: int = 4096) -> None:
        self.engine = engine
        self.max_entries = max_entries
        self._memo: OrderedDict[tuple, AloneRun] = OrderedDict()
        self._count = 0

    def alone(self, prompt: list[int], params: SamplingParams) -> AloneRun:
        """The request alone, with top-TOP sampled and prompt logprobs."""
        params = replace(params, logprobs=TOP, prompt_logprobs=TOP)
        return self._memoized((tuple(prompt), params))

    def scored(self, tokens: list[int]) -> list[TokenLogprobs | None]:
        """Teacher forcing: the prompt logprobs of ``tokens`` scored alone (top TOP)."""
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=TOP)
        run = self._memoized((tuple(tokens), params))
        assert run.prompt_logprobs is not None
        return run.prompt_logprobs

    def _memoized(self, key: tuple) -> AloneRun:
        run = self._memo.get(key)
        if run is None:
            run = self._run(list(key[0]), key[1])
            self._memo[key] = run
            if len(self._memo) > self.max_entries:
                self._memo.popitem(last=False)
        else:
            self._memo.move_to_end(key)
        return run

    def _run(self, prompt: list[int], params: SamplingParams) -> AloneRun:
        engine = self.engine
        self._count += 1
        stream = submit(engine, prompt, params, request_id=f"alone-{self._count}")
        for _ in range(DRAIN_STEPS):
            if not step(engine):
                break
        events = drain(stream)
        assert events and events[-1].finished, "the alone run did not finish"
        assert not any(e.finished for e in events[:-1])
        last = events[-1]
        assert last.finish_reason in (FinishReason.STOP, FinishReason.LENGTH), last
        assert engine.dead is None and not any(engine.restarts.values()), engine.restarts
        assert engine.pool.num_free == engine.pool.num_pages, "the alone engine leaked pages"
        return AloneRun(
            tokens=[t for e in events for t in e.token_ids],
            text="".join(e.text for e in events),
            finish_reason=last.finish_reason,
            stop_reason=last.stop_reason,
            logprobs=[lp for e in events for lp in (e.logprobs or [])],
            prompt_logprobs=events[0].prompt_logprobs,
        )


def step(engine: AsyncEngine) -> bool:
    """engine.step() in the engine's worker thread, where the worker set torch's thread count
    (device.threads): called from another thread, the model runs with torch's default threads,
    which on a busy two-core machine made steps 50-100x slower (spinning OpenMP workers)."""
    return engine._executor.submit(engine.step).result()


def submit(
    engine: AsyncEngine,
    prompt: list[int],
    params: SamplingParams,
    request_id: str | None = None,
    priority: int = 0,
) -> EventStream:
    """What every caller does: validate through the engine's one input path (a bad request
    raises ValueError), then queue with a sink into a stream of the caller's own."""
    params = engine.inputs.sampling_params(params, {})
    ids = engine.inputs.prompt_token_ids(prompt, params)
    events: EventStream[None] = EventStream()
    engine.add_request(
        ids, params, sink=events.sink(None), request_id=request_id, priority=priority
    )
    return events


def drain(stream: EventStream) -> list[TokenEvent]:
    return [event for _, event in stream.drain()]


# -- the world: engines, model folder and counters, kept across examples --------------------------


class ErrorLog(logging.Handler):
    """Keeps the engine's error log records, to show with a failure."""

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if record.exc_info:
            text += "\n" + logging.Formatter().formatException(record.exc_info)
        self.records.append(text)


class FuzzWorld:
    """What outlives one example: the model folder, the engine under test (rebuilt only after a
    failure), the oracle engine, and the counters a run reports."""

    def __init__(self, folder: Path, setup: FuzzSetup | None = None) -> None:
        self.folder = folder
        self.setup = setup or FuzzSetup()
        self.stats: Counter[str] = Counter()
        self.errors = ErrorLog()
        logging.getLogger("yaied").addHandler(self.errors)
        self.engine = self._new_engine()
        oracle_engine = AsyncEngine(
            load_config(
                env={},
                overrides={
                    "model": str(folder),
                    "dtype": "float32",
                    "max_model_len": self.setup.max_model_len,
                    "kv_cache_gib": (self.setup.max_model_len + PAGE_SIZE)
                    * BYTES_PER_TOKEN
                    / 2**30,
                    "max_num_batched_tokens": self.setup.max_model_len,
                    "max_num_seqs": 1,
                    "enable_prefix_caching": False,
                    "threads": 1,
                    "device": "cpu",
                },
            ),
            show_progress=False,
        )
        self.oracle = Oracle(oracle_engine)
        tokenizer = self.engine.tokenizer
        assert tokenizer is not None, "the fuzz model has no tokenizer"
        self._decode = tokenizer.backend_tokenizer.decode

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._decode(ids, skip_special_tokens=skip_special_tokens)

    def _new_engine(self) -> AsyncEngine:
        s = self.setup
        config = load_config(
            env={},
            overrides={
                "model": str(self.folder),
                "dtype": "float32",
                "max_model_len": s.max_model_len,
                "kv_cache_gib": s.kv_cache_gib,
                "max_num_batched_tokens": s.max_num_batched_tokens,
                "max_num_seqs": s.max_num_seqs,
                "page_size": s.page_size,
                "policy": s.policy,
                "attention_backend": s.attention_backend,
                "device": "cpu",  # a CUDA pool is sized from free memory, not num_pages
                "threads": 1,
                "speculative_method": "ngram" if s.num_speculative_tokens else "",
                "num_speculative_tokens": max(s.num_speculative_tokens, 1),
                "speculative_max_batch_size": 0,
                "prompt_lookup_min": 1,  # draft as often as possible
            },
        )
        engine = AsyncEngine(config, show_progress=False)
        assert engine.info.num_pages == s.num_pages, engine.info
        assert engine.info.page_size == s.page_size
        return engine

    def engine_for_example(self) -> AsyncEngine:
        """The engine, idle and whole, its prefix cache emptied (unless carry_cache) and its
        sampler reseeded, so the example replays exactly."""
        engine = self.engine
        if engine.dead is not None or any(engine.restarts.values()) or not idle_and_whole(engine):
            self.discard_engine()
            engine = self.engine
        if not self.setup.carry_cache:
            engine.cache.tree.reset()
        engine.worker.runner.generator.manual_seed(engine.config.model.seed)
        self.errors.records.clear()
        return engine

    def discard_engine(self) -> None:
        """After a failure: a new engine for the next example (hypothesis replays examples while
        it shrinks, and each must start from a sane engine)."""
        self.engine._executor.shutdown(wait=False)
        self.engine = self._new_engine()
        self.stats["engines_rebuilt"] += 1

    def close(self) -> None:
        logging.getLogger("yaied").removeHandler(self.errors)
        self.engine._executor.shutdown(wait=False)
        self.oracle.engine._executor.shutdown(wait=False)


def idle_and_whole(engine: AsyncEngine) -> bool:
    """No stream open, no request known, every page free or cached and unlocked."""
    pool, tree = engine.pool, engine.cache.tree
    return (
        not engine._streams
        and not engine._inbox
        and not engine.scheduler.requests
        and pool.num_free + tree.num_cached_pages == pool.num_pages
        and tree.num_evictable_pages == tree.num_cached_pages
    )


# -- what one submission draws --------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """One submission as drawn; turned into SamplingParams by EngineMachine._params."""

    temperature: float
    seed: int | None
    top_k: int
    top_p: float
    min_p: float
    max_tokens: int  # 0: echo scoring as the server runs it (one token, dropped)
    ignore_eos: bool
    min_tokens: int
    logprobs: int | None
    prompt_logprobs: int | None
    stop_ids: tuple[float, ...]  # where in the request's own output to pick each (or an id)
    stop_strs: tuple[tuple[float, int], ...]  # (where, how many characters)
    include_stop: bool
    skip_special: bool
    penalties: bool
    bias: int | None  # a token to push up (logit_bias +8)
    n: int
    priority: int


specs = st.builds(
    Spec,
    temperature=st.sampled_from([0.0, 0.0, 0.8, 1.5]),
    seed=st.none() | st.integers(0, 1000),
    top_k=st.sampled_from([0, 0, 1, 5, 40]),
    top_p=st.sampled_from([1.0, 1.0, 0.9, 0.5]),
    min_p=st.sampled_from([0.0, 0.0, 0.2]),
    max_tokens=st.sampled_from([1, 16, 33, 0, 2, 5, 16, 33]),
    ignore_eos=st.booleans(),
    min_tokens=st.sampled_from([0, 0, 0, 2, 6]),
    logprobs=st.sampled_from([None, None, 0, 2, 5]),
    prompt_logprobs=st.sampled_from([None, None, None, 0, 1, 3]),
    stop_ids=st.lists(st.floats(0, 1, exclude_max=True), max_size=2).map(tuple),
    stop_strs=st.lists(
        st.tuples(st.floats(0, 1, exclude_max=True), st.integers(1, 3)), max_size=2
    ).map(tuple),
    include_stop=st.booleans(),
    skip_special=st.sampled_from([True, True, False]),
    penalties=st.booleans(),
    bias=st.none() | st.integers(0, 255),
    n=st.sampled_from([1, 1, 1, 2, 3]),
    priority=st.integers(0, 2),
)
segment_runs = st.lists(st.integers(0, len(SEGMENTS) - 1), min_size=1, max_size=5)
loose_tokens = st.lists(st.integers(0, 255), max_size=3)


def is_deterministic(params: SamplingParams) -> bool:
    return params.greedy or params.seed is not None


def has_gap(params: SamplingParams) -> bool:
    """Whether the alone run's raw logprobs show the decision a greedy step made (no penalty or
    bias moved the logits)."""
    return params.greedy and not params.has_penalties and not params.logit_bias


# -- per-request bookkeeping ----------------------------------------------------------------------


@dataclass
class Tracked:
    rid: str
    group: str
    prompt: list[int]
    params: SamplingParams
    drop: bool  # max_tokens 0: the server would report no output
    stream: EventStream  # where its events arrive
    live: RequestStream  # the engine's own record of it (status, computed tokens)
    tokens: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    final: TokenEvent | None = None
    abort_sent: bool = False
    was_running: bool = False
    preempted: bool = False

    def describe(self) -> str:
        return (
            f"request {self.rid}: prompt ({len(self.prompt)}) {self.prompt}, params {self.params}, "
            f"output {self.tokens}, preempted {self.preempted}, abort sent {self.abort_sent}"
        )


class FuzzFailure(AssertionError):
    pass


# -- the state machine ----------------------------------------------------------------------------


def machine_class(world: FuzzWorld) -> type[RuleBasedStateMachine]:
    """The state machine over ``world``'s engine (a class per world: hypothesis builds a fresh
    instance for every example)."""

    class EngineMachine(RuleBasedStateMachine):
        requests = Bundle("requests")

        def __init__(self) -> None:
            super().__init__()
            self.world = world
            self.setup = world.setup
            self.engine = world.engine_for_example()
            self.oracle = world.oracle
            self.stats = world.stats
            self.open: dict[str, Tracked] = {}
            self.closed: dict[str, Tracked] = {}
            self.broken = False
            self.steps = 0  # engine steps in this example
            self.last_progress = 0
            self.progress_mark: tuple[int, int] = (0, 0)
            self.high_water: dict[str, int] = {}
            self.num_submits = 0
            self.stats["examples"] += 1
            self.preemptions_before = self.engine.scheduler.num_preemptions

        # -- failing ---------------------------------------------------------------------------

        def _rule(self) -> None:
            self.stats["rules"] += 1

        @contextlib.contextmanager
        def guard(self) -> Iterator[None]:
            """Marks the example broken when anything fails (teardown then replaces the engine
            instead of checking it again)."""
            try:
                yield
            except BaseException:
                self.broken = True
                raise

        def fail(self, message: str, tracked: Tracked | None = None) -> None:
            parts = [message]
            if tracked is not None:
                parts.append(tracked.describe())
            if world.errors.records:
                parts.append("engine errors:\n" + "\n".join(world.errors.records[-3:]))
            raise FuzzFailure("\n".join(parts))

        # -- rules -----------------------------------------------------------------------------

        @rule(target=requests, runs=segment_runs, loose=loose_tokens, spec=specs)
        def submit(self, runs: list[int], loose: list[int], spec: Spec):
            self._rule()
            prompt = [t for i in runs for t in SEGMENTS[i]] + loose
            return self._submit(prompt, spec)

        @rule(target=requests, parent=requests, loose=loose_tokens, spec=specs)
        def follow_up(self, parent: str, loose: list[int], spec: Spec):
            """The next turn of a conversation: an earlier prompt, its output so far, more."""
            self._rule()
            tracked = self.open.get(parent) or self.closed[parent]
            return self._submit(tracked.prompt + tracked.tokens + loose, spec)

        @rule(rid=requests, group=st.booleans())
        def abort(self, rid: str, group: bool) -> None:
            """One request, or (a client leaving an n > 1 call) every choice of its call."""
            self._rule()
            if group:
                group_id = (self.open.get(rid) or self.closed[rid]).group
                for other in [t.rid for t in self.open.values() if t.group == group_id]:
                    self._abort(other)
            else:
                self._abort(rid)

        def _abort(self, rid: str) -> None:
            with self.guard():
                self.engine.abort(rid)  # a no-op for a finished request
                if rid in self.open:
                    self.open[rid].abort_sent = True
                    self.stats["aborts"] += 1
                    live = self.open[rid].live
                    queued = live in self.engine._inbox
                    self.stats[f"aborts_{'queued' if queued else live.request.status.value}"] += 1

        @rule(n=st.integers(1, 4))
        def step(self, n: int) -> None:
            self._rule()
            with self.guard():
                for _ in range(n):
                    self._step()

        @rule(n=st.integers(4, 12))
        def steps(self, n: int) -> None:
            self._rule()
            with self.guard():
                for _ in range(n):
                    self._step()

        @rule()
        def run_until_idle(self) -> None:
            self._rule()
            with self.guard():
                self._drain()

        @rule(
            kind=st.sampled_from(
                ["duplicate_id", "empty", "out_of_range", "too_long", "bad_stop_id", "bad_bias"]
            ),
            rid=requests,
        )
        def bad_request(self, kind: str, rid: str) -> None:
            """Invalid submissions raise ValueError and change nothing."""
            self._rule()
            with self.guard():
                engine = self.engine
                prompt, params, request_id = [5, 6, 7], SamplingParams(max_tokens=2), None
                if kind == "duplicate_id":
                    if rid not in engine._streams:
                        return
                    request_id = rid
                elif kind == "empty":
                    prompt = []
                elif kind == "out_of_range":
                    prompt = [3, 256]
                elif kind == "too_long":
                    prompt = [3] * self.setup.max_model_len
                elif kind == "bad_stop_id":
                    params = SamplingParams(max_tokens=2, stop_token_ids=[300])
                else:
                    params = SamplingParams(max_tokens=2, logit_bias={999: 1.0})
                before = (dict(engine._streams), len(engine._inbox))
                try:
                    submit(engine, prompt, params, request_id=request_id)
                except ValueError:
                    pass
                else:
                    self.fail(f"bad request ({kind}) was accepted")
                if (dict(engine._streams), len(engine._inbox)) != before:
                    self.fail(f"a rejected request ({kind}) changed the engine's state")
                self.stats["bad_requests"] += 1

        @invariant()
        def consistent(self) -> None:
            with self.guard():
                self._check()

        def teardown(self) -> None:
            if self.broken:
                world.discard_engine()
                return
            try:
                self._drain()
                for tracked in self.closed.values():
                    if drain(tracked.stream):
                        self.fail("an event after the final one", tracked)
                if self.open or not idle_and_whole(self.engine):
                    self.fail(f"not idle and whole at the end: open {sorted(self.open)}")
                preempted = self.engine.scheduler.num_preemptions - self.preemptions_before
                self.stats["preemptions"] += preempted
            except BaseException:
                world.discard_engine()
                raise

        # -- submitting ------------------------------------------------------------------------

        def _submit(self, prompt: list[int], spec: Spec):
            with self.guard():
                # Backpressure by stepping, not by a precondition: whether a rule may run must
                # not depend on the engine, or with carry_cache hypothesis sees the same draws
                # lead to different rules (FlakyStrategyDefinition).
                while len(self.open) >= self.setup.max_open:
                    self._step()
                self.num_submits += 1
                group = f"e{self.stats['examples']}-{self.num_submits}"
                params, drop = self._params(prompt, spec)
                prompt = prompt[: self.setup.max_model_len - params.max_tokens]
                ids = [group] if spec.n == 1 else [f"{group}-{i}" for i in range(spec.n)]
                for k, rid in enumerate(ids):
                    # n > 1 as the server fans it out (yaied/server/serving.py, build_jobs): one
                    # request per choice, ids <call>-<k>, choice k seeded with seed + k.
                    own = params if params.seed is None else replace(params, seed=params.seed + k)
                    stream = submit(
                        self.engine, prompt, own, request_id=rid, priority=spec.priority
                    )
                    live = self.engine._streams[rid]
                    tracked = Tracked(rid, group, prompt, own, drop, stream, live)
                    self.open[rid] = tracked
                    self.stats["requests"] += 1
                    if len(prompt) > self.setup.max_num_batched_tokens:
                        self.stats["requests_chunked"] += 1
                return multiple(*ids)

        def _params(self, prompt: list[int], spec: Spec) -> tuple[SamplingParams, bool]:
            """Spec to SamplingParams; stop ids and strings are picked from the request's own
            output (run alone without them) when it is deterministic, so that they hit."""
            drop = spec.max_tokens == 0
            max_tokens = 1 if drop else spec.max_tokens
            prompt = prompt[: self.setup.max_model_len - max_tokens]
            values = dict(
                max_tokens=max_tokens,
                temperature=spec.temperature,
                seed=spec.seed,
                top_k=spec.top_k,
                top_p=spec.top_p,
                min_p=spec.min_p,
                ignore_eos=spec.ignore_eos,
                min_tokens=0 if drop else min(spec.min_tokens, max_tokens),
                logprobs=spec.logprobs,
                prompt_logprobs=spec.prompt_logprobs,
                skip_special_tokens=spec.skip_special,
            )
            if drop:  # the server's echo scoring: logprobs N, echo, max_tokens 0
                n = spec.logprobs if spec.logprobs is not None else 1
                values.update(logprobs=n, prompt_logprobs=n)
            if spec.penalties:
                values.update(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2)
            if spec.bias is not None:
                values.update(logit_bias={spec.bias: 8.0})
            params = SamplingParams(**values)
            if drop or not (spec.stop_ids or spec.stop_strs):
                return params, drop
            if is_deterministic(params):
                base = self.oracle.alone(prompt, params)
                text = base.text
                stop_ids = [base.tokens[int(f * len(base.tokens))] for f in spec.stop_ids]
                stops = [text[int(f * len(text)) :][:k] for f, k in spec.stop_strs if text]
            else:
                stop_ids = [int(f * 256) for f in spec.stop_ids]
                stops = [LOOSE_STOPS[int(f * len(LOOSE_STOPS))] for f, _ in spec.stop_strs]
            # A stop string with U+FFFD would match half-decoded bytes; an empty one is ignored.
            stops = [s for s in stops if s and "\ufffd" not in s]
            params = replace(
                params,
                stop_token_ids=tuple(stop_ids),
                stop=tuple(stops),
                include_stop_str_in_output=spec.include_stop,
            )
            return params, drop

        # -- stepping --------------------------------------------------------------------------

        def _step(self) -> None:
            aborting = [t for t in self.open.values() if t.abort_sent]
            did = step(self.engine)
            self.steps += 1
            self.stats["engine_steps"] += did
            self._check()
            for tracked in aborting:
                if tracked.final is None:
                    self.fail("an aborted request did not end at the next step", tracked)
            if not did and self.open:
                self.fail(
                    f"stuck: the engine is idle with {len(self.open)} open streams "
                    f"({sorted(self.open)}; waiting "
                    f"{[r.request_id for r in self.engine.scheduler.waiting]})"
                )
            if self.steps - self.last_progress > STALL_STEPS:
                self.fail(f"no progress for {STALL_STEPS} steps: open {sorted(self.open)}")

        def _drain(self) -> None:
            for _ in range(DRAIN_STEPS):
                if not self.open and not self.engine._streams:
                    return
                self._step()
            self.fail(f"still not done after {DRAIN_STEPS} steps: open {sorted(self.open)}")

        # -- checking --------------------------------------------------------------------------

        def _check(self) -> None:
            engine = self.engine
            if engine.dead is not None:
                self.fail(f"the engine died: {engine.dead!r}")
            if any(engine.restarts.values()):
                self.fail(f"the engine rebuilt its bookkeeping: {engine.restarts}")
            check_invariants(engine.scheduler, len(engine._streams), len(engine._inbox))
            check_pages(engine, self.fail)
            for tracked in list(self.open.values()):
                for event in drain(tracked.stream):
                    self._on_event(tracked, event)
                self._watch(tracked)
            if set(engine._streams) != set(self.open):
                self.fail(
                    f"the engine's open streams {sorted(engine._streams)} are not the ones "
                    f"without a final event {sorted(self.open)}"
                )
            mark = (self.stats["events"], sum(self.high_water.values()))
            if mark != self.progress_mark or not self.open:
                self.progress_mark, self.last_progress = mark, self.steps

        def _watch(self, tracked: Tracked) -> None:
            request = tracked.live.request
            if request.status is RequestStatus.RUNNING:
                tracked.was_running = True
            elif request.status is RequestStatus.WAITING and tracked.was_running:
                if not tracked.preempted:
                    self.stats["requests_preempted"] += 1
                tracked.preempted = True
            mark = request.num_computed_tokens + len(request.output_token_ids)
            if mark > self.high_water.get(tracked.rid, 0):
                self.high_water[tracked.rid] = mark
            if tracked.final is not None:
                self.high_water.pop(tracked.rid, None)

        def _on_event(self, tracked: Tracked, event: TokenEvent) -> None:
            self.stats["events"] += 1
            params = tracked.params
            if event.request_id != tracked.rid:
                self.fail(f"event of {event.request_id} in the stream of {tracked.rid}")
            if event.num_prompt_tokens != len(tracked.prompt):
                self.fail(f"num_prompt_tokens {event.num_prompt_tokens}", tracked)
            # A speculative step adds its accepted drafts and the sampled token at once.
            most = 1 + self.setup.num_speculative_tokens
            if event.finished:
                if event.finish_reason in (FinishReason.ABORT, FinishReason.ERROR):
                    ok = not event.token_ids
                else:
                    ok = 1 <= len(event.token_ids) <= most
            else:
                ok = 1 <= len(event.token_ids) <= most
            if not ok:
                self.fail(f"event with {len(event.token_ids)} tokens: {event}", tracked)
            if event.token_ids and params.prompt_logprobs is not None and not tracked.tokens:
                if event.prompt_logprobs is None:
                    self.fail("the first token came without prompt logprobs", tracked)
                tracked.prompt_logprobs = event.prompt_logprobs
            elif event.prompt_logprobs is not None:
                self.fail("prompt logprobs on an event other than the first token's", tracked)
            tracked.tokens.extend(event.token_ids)
            tracked.text.append(event.text)
            if event.num_output_tokens != len(tracked.tokens):
                self.fail(f"num_output_tokens {event.num_output_tokens}", tracked)
            if params.logprobs is not None and event.token_ids:
                lps = event.logprobs or []
                if [lp.token_id for lp in lps] != event.token_ids:
                    self.fail(f"logprobs {lps} for tokens {event.token_ids}", tracked)
                for lp in lps:
                    check_logprob_shape(lp, params.logprobs, self.fail, tracked)
                tracked.logprobs.extend(lps)
            elif event.logprobs:
                self.fail("logprobs nobody asked for", tracked)
            if event.finished:
                tracked.final = event
                del self.open[tracked.rid]
                self.closed[tracked.rid] = tracked
                self._on_final(tracked)

        def _on_final(self, tracked: Tracked) -> None:
            final = tracked.final
            assert final is not None
            reason = final.finish_reason
            self.stats[f"finished_{reason.value}"] += 1
            if reason is FinishReason.ERROR:
                self.fail(f"the request failed: {final.error}", tracked)
            if reason is FinishReason.ABORT and not tracked.abort_sent:
                self.fail("aborted without an abort", tracked)
            if final.num_cached_tokens > 0:
                self.stats["requests_prefix_hit"] += 1
            if tracked.drop and reason is not FinishReason.ABORT:
                # Echo scoring (max_tokens 0) answers with the prompt logprobs alone.
                if tracked.prompt_logprobs is None:
                    self.fail("echo scoring got no prompt logprobs", tracked)
                self.stats["echo_scored"] += 1
            self._check_stop(tracked)
            self._check_text(tracked)
            self._check_prompt_logprobs(tracked)
            self._check_logprobs(tracked)
            self._check_alone(tracked)

        def _check_stop(self, tracked: Tracked) -> None:
            final, params, out = tracked.final, tracked.params, tracked.tokens
            assert final is not None
            reason = final.finish_reason
            eos = set() if params.ignore_eos else {EOS}
            stoppers = eos | set(params.stop_token_ids)
            for i, token in enumerate(out[:-1]):
                if token in stoppers and i + 1 >= params.min_tokens:
                    self.fail(f"token {i} ({token}) should have stopped the request", tracked)
            for token in out[: params.min_tokens]:
                if token in stoppers:
                    self.fail(f"stop token {token} sampled before min_tokens", tracked)
            if len(out) > params.max_tokens:
                self.fail("more tokens than max_tokens", tracked)
            if reason is FinishReason.LENGTH:
                full = len(tracked.prompt) + len(out) >= self.setup.max_model_len
                if len(out) != params.max_tokens and not full:
                    self.fail("finished for length early", tracked)
                if final.stop_reason is not None:
                    self.fail(f"length with stop_reason {final.stop_reason!r}", tracked)
            elif reason is FinishReason.STOP:
                if isinstance(final.stop_reason, str):
                    if final.stop_reason not in params.stop:
                        self.fail(f"stop_reason {final.stop_reason!r} is no stop string", tracked)
                    self.stats["stopped_by_string"] += 1
                    if len(out) < params.min_tokens:  # stop strings wait for min_tokens
                        self.fail("a stop string ended the request before min_tokens", tracked)
                else:
                    last = out[-1] if out else None
                    if last not in stoppers:
                        self.fail("stopped on no stop token", tracked)
                    expected = last if last in params.stop_token_ids else None
                    if final.stop_reason != expected:
                        self.fail(f"stop_reason {final.stop_reason!r}, not {expected}", tracked)
                    self.stats["stopped_by_token"] += 1

        def _check_text(self, tracked: Tracked) -> None:
            """The streamed text is decode(output) (byte-level: exactly), cut at a stop string;
            an aborted stream's text is a prefix of it."""
            final, params = tracked.final, tracked.params
            assert final is not None
            text = "".join(tracked.text)
            decoded = world.decode(tracked.tokens, params.skip_special_tokens)
            if final.finish_reason is FinishReason.ABORT:
                if not decoded.startswith(text):
                    self.fail(f"aborted text {text!r} is not a prefix of {decoded!r}", tracked)
                return
            expected = decoded
            # Stop strings count from the min_tokens-th token on: the text decided before it
            # (all but a trailing part of a character) is passed on unmatched.
            skip = 0
            if params.min_tokens > 1:
                head = world.decode(
                    tracked.tokens[: params.min_tokens - 1], params.skip_special_tokens
                )
                skip = len(head.rstrip("\ufffd"))
            matches = [
                (decoded.find(s, skip) + len(s), decoded.find(s, skip), s) for s in params.stop
            ]
            matches = [m for m in matches if m[1] >= 0]
            if isinstance(final.stop_reason, str):
                if not matches:
                    self.fail(f"stop string {final.stop_reason!r} not in {decoded!r}", tracked)
                end, start, stop = min(matches)
                if stop != final.stop_reason:
                    self.fail(f"stopped on {final.stop_reason!r}, {stop!r} came first", tracked)
                expected = decoded[: end if params.include_stop_str_in_output else start]
            elif matches:
                self.fail(f"stop string {min(matches)[2]!r} in {decoded!r} did not stop", tracked)
            if text != expected:
                self.fail(f"text {text!r} != {expected!r} (decoded {decoded!r})", tracked)
            self.stats["texts_checked"] += 1

        def _check_prompt_logprobs(self, tracked: Tracked) -> None:
            n = tracked.params.prompt_logprobs
            got = tracked.prompt_logprobs
            if n is None or got is None:
                return
            prompt = tracked.prompt
            if len(got) != len(prompt) or got[0] is not None:
                self.fail(f"{len(got)} prompt logprobs for {len(prompt)} tokens", tracked)
            want = self.oracle.scored(prompt)
            for i in range(1, len(prompt)):
                lp = got[i]
                if lp is None or lp.token_id != prompt[i]:
                    self.fail(f"prompt logprob {i} is {lp}, for token {prompt[i]}", tracked)
                check_logprob_shape(lp, n, self.fail, tracked)
                compare_logprobs(lp, want[i], n, self.fail, tracked, f"prompt position {i}")
            self.stats["prompt_logprobs_checked"] += 1

        def _check_logprobs(self, tracked: Tracked) -> None:
            """Teacher forcing: token i's logprobs equal those of the prompt + output scored
            alone, at position len(prompt) + i."""
            if tracked.params.logprobs is None or not tracked.tokens:
                return
            tokens = (tracked.prompt + tracked.tokens)[: self.setup.max_model_len - 1]
            want = self.oracle.scored(tokens)
            for i, lp in enumerate(tracked.logprobs):
                j = len(tracked.prompt) + i
                if j < len(tokens):
                    where = f"output token {i}"
                    compare_logprobs(
                        lp, want[j], tracked.params.logprobs, self.fail, tracked, where
                    )
            self.stats["logprobs_checked"] += 1

        def _check_alone(self, tracked: Tracked) -> None:
            """A deterministic request's output equals the same request run alone; a greedy one
            may part ways at a near tie of the alone run, and is not compared after it."""
            final, params = tracked.final, tracked.params
            assert final is not None
            if not is_deterministic(params):
                return
            alone = self.oracle.alone(tracked.prompt, params)
            ours, theirs = tracked.tokens, alone.tokens
            for i, (a, b) in enumerate(zip(ours, theirs, strict=False)):
                if a == b:
                    continue
                tie = near_tie(alone.logprobs[i], params, i) if has_gap(params) else None
                gap = None if tie is None else tie[0]
                if tie is None or tie[0] >= NEAR_TIE or a not in tie[1]:
                    self.fail(
                        f"output token {i} is {a}, alone {b} (alone output {theirs}, decision "
                        f"gap {gap}, top {alone.logprobs[i]})",
                        tracked,
                    )
                self.stats["near_tie_divergences"] += 1
                return
            if final.finish_reason is FinishReason.ABORT:
                if len(ours) > len(theirs):
                    self.fail(f"longer than alone {theirs}", tracked)
                self.stats["alone_checked_prefix"] += 1
                return
            if ours != theirs:
                self.fail(f"output differs from alone {theirs}", tracked)
            if (final.finish_reason, final.stop_reason) != (alone.finish_reason, alone.stop_reason):
                self.fail(
                    f"finished {final.finish_reason} {final.stop_reason!r}, alone "
                    f"{alone.finish_reason} {alone.stop_reason!r}",
                    tracked,
                )
            if "".join(tracked.text) != alone.text:
                self.fail(f"text differs from alone {alone.text!r}", tracked)
            self.stats["alone_checked"] += 1
            if tracked.preempted:
                self.stats["alone_checked_preempted"] += 1
            if final.num_cached_tokens:
                self.stats["alone_checked_prefix_hit"] += 1
            if len(tracked.prompt) > self.setup.max_num_batched_tokens:
                self.stats["alone_checked_chunked"] += 1

    EngineMachine.__name__ = EngineMachine.__qualname__ = "EngineMachine"
    return EngineMachine


# -- checks over the engine's state ---------------------------------------------------------------


def check_pages(engine: AsyncEngine, fail) -> None:
    """Every page id is exactly one of: free, in one tree node, or owned by one running request.
    The tree is well formed, its counters are right, each node's lock count is the number of
    running requests locking it or a node below it, and every running request's shared pages
    are the tree's pages for its own tokens."""
    pool, tree, scheduler = engine.pool, engine.cache.tree, engine.scheduler
    size = pool.page_size
    owner: dict[int, str] = {}

    def claim(page: int, who: str) -> None:
        if not 0 <= page < pool.num_pages:
            fail(f"page id {page} out of range ({who})")
        if page in owner:
            fail(f"page {page} is both {owner[page]} and {who}")
        owner[page] = who

    for page in pool._free:
        claim(page, "free")
    if sum(pool._is_free) != len(pool._free) or not all(pool._is_free[p] for p in pool._free):
        fail("the pool's free flags disagree with its free list")
    nodes = []
    stack = [tree.root]
    cached = evictable = 0
    while stack:
        node = stack.pop()
        for key, child in node.children.items():
            if child.parent is not node or key != child.tokens[:size]:
                fail(f"a tree node is linked wrong: {child}")
            if not child.pages or len(child.tokens) != len(child.pages) * size:
                fail(f"a tree node's tokens do not fill its pages: {child}")
            for page in child.pages:
                claim(page, "cached")
            cached += len(child.pages)
            evictable += len(child.pages) if child.lock_ref == 0 else 0
            nodes.append(child)
            stack.append(child)
    if cached != tree.num_cached_pages or evictable != tree.num_evictable_pages:
        fail(
            f"tree counters: {tree.num_cached_pages} cached, {tree.num_evictable_pages} "
            f"evictable; walked {cached}, {evictable}"
        )
    locks: Counter[int] = Counter()
    for request in scheduler.running:
        rid = request.request_id
        path = []
        node = request.prefix_node
        while node is not tree.root:
            if node is None or node.parent is None:
                fail(f"running request {rid} locks a node outside the tree")
            path.append(node)
            node = node.parent
        locks[id(request.prefix_node)] += 1
        path.reverse()
        shared = [p for n in path for p in n.pages]
        tokens = tuple(t for n in path for t in n.tokens)
        if request.page_ids[: request.num_shared_pages] != shared:
            fail(f"request {rid}: shared pages {request.page_ids} are not its node's {shared}")
        if tuple(request.all_token_ids[: len(tokens)]) != tokens:
            fail(f"request {rid} shares the pages of other tokens")
        if not len(tokens) <= request.num_computed_tokens <= request.num_tokens:
            computed = request.num_computed_tokens
            fail(f"request {rid}: {computed} computed tokens, {len(tokens)} shared")
        if not (
            pool.pages_for(request.num_computed_tokens)
            <= len(request.page_ids)
            <= pool.pages_for(request.num_tokens)
        ):
            fail(f"request {rid}: {len(request.page_ids)} pages for {request.num_tokens} tokens")
        for page in request.page_ids[request.num_shared_pages :]:
            claim(page, f"owned by {rid}")
    for node in nodes:
        users = _locks_at_or_below(node, locks)
        if node.lock_ref != users:
            fail(f"a tree node's lock count is {node.lock_ref}, with {users} users: {node}")
    if len(owner) != pool.num_pages:
        missing = sorted(set(range(pool.num_pages)) - set(owner))
        fail(f"pages leaked (neither free, cached nor owned): {missing}")


def _locks_at_or_below(node, locks: Counter[int]) -> int:
    total = locks[id(node)]
    stack = list(node.children.values())
    while stack:
        child = stack.pop()
        total += locks[id(child)]
        stack.extend(child.children.values())
    return total


def check_logprob_shape(lp: TokenLogprobs, n: int, fail, tracked: Tracked) -> None:
    if len(lp.top_ids) != n or len(lp.top_logprobs) != n:
        fail(f"{len(lp.top_ids)} top logprobs, asked for {n}: {lp}", tracked)
    tops = lp.top_logprobs
    if lp.logprob > 1e-6 or any(b > a + 1e-6 for a, b in zip(tops, tops[1:], strict=False)):
        fail(f"logprobs out of order or positive: {lp}", tracked)
    if lp.token_id in lp.top_ids:
        k = lp.top_ids.index(lp.token_id)
        if abs(lp.top_logprobs[k] - lp.logprob) > TOL:
            fail(f"the token's logprob differs from its top entry: {lp}", tracked)


def _close(got: float, want: float) -> bool:
    return abs(got - want) <= TOL + REL_TOL * min(abs(want), 8.0)  # at most 5e-4 in all


def compare_logprobs(
    got: TokenLogprobs, want: TokenLogprobs | None, n: int, fail, tracked: Tracked, where: str
) -> None:
    """``got`` (top n) against the oracle's ``want`` (top TOP) for the same token and context."""
    if want is None or got.token_id != want.token_id:
        fail(f"{where}: scored token {got} vs alone {want}", tracked)
    if not _close(got.logprob, want.logprob):
        fail(f"{where}: logprob {got.logprob} vs alone {want.logprob}", tracked)
    for k in range(n):
        if not _close(got.top_logprobs[k], want.top_logprobs[k]):
            fail(f"{where}: top {k} logprob {got} vs alone {want}", tracked)
        token = got.top_ids[k]
        if token in want.top_ids:
            other = want.top_logprobs[want.top_ids.index(token)]
            if not _close(got.top_logprobs[k], other):
                fail(f"{where}: top {k} token {token}: {got} vs alone {want}", tracked)
        elif k < TOP - 1:
            fail(f"{where}: top {k} token {token} not in the alone top {want}", tracked)


def near_tie(lp: TokenLogprobs, params: SamplingParams, i: int) -> tuple[float, set[int]] | None:
    """The alone run's margin between its two best candidates at output step i and those two,
    leaving out the tokens min_tokens bans there; None when fewer than two are known."""
    banned: set[int] = set()
    if i < params.min_tokens:
        banned = set(params.stop_token_ids) | (set() if params.ignore_eos else {EOS})
    pairs = zip(lp.top_ids, lp.top_logprobs, strict=True)
    best = [(t, v) for t, v in pairs if t not in banned][:2]
    if len(best) < 2:
        return None
    return best[0][1] - best[1][1], {best[0][0], best[1][0]}


# -- running --------------------------------------------------------------------------------------


def fuzz_settings(**overrides) -> settings:
    values = dict(
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        stateful_step_count=40,
        max_examples=20,
    )
    values.update(overrides)
    return settings(**values)


def run(world: FuzzWorld, fuzz: settings) -> None:
    """One hypothesis run of the machine over ``world``; raises on the first failure. A
    derandomized run draws without the constants of the modules imported so far (see
    ``without_local_constants``), so it draws the same examples whatever ran before it."""
    run_machine(machine_class(world), fuzz)


def run_machine(machine: type[RuleBasedStateMachine], fuzz: settings) -> None:
    pin = without_local_constants() if fuzz.derandomize else contextlib.nullcontext()
    with pin:
        run_state_machine_as_test(machine, settings=fuzz)


@contextlib.contextmanager
def without_local_constants() -> Iterator[None]:
    """Hypothesis (6.131 on) now and then draws, instead of a random value, a literal constant
    of any local module (not stdlib, not site-packages, not a test file) in ``sys.modules`` at
    the time of the draw. A derandomized run's seed is fixed, but that pool is not: a test that
    imported yaied.engine.sim_workloads earlier in the process adds its floats and ints, and the
    fuzzer drew other stop positions, other runs of rules, and (2026-11-29, fuzzer after
    tests/engine/test_simulator.py) 122 examples instead of 115, none of which aborted a waiting
    request. Within this context the pool is empty. It reaches into Hypothesis' internals: a
    Hypothesis without them has nothing to pin, and tests/engine/test_engine_fuzz.py checks that
    the draws stay the same after a new module's import."""
    try:
        from hypothesis.internal.conjecture import providers
        from hypothesis.internal.constants_ast import Constants
    except ImportError:
        providers = None
    if providers is None or not hasattr(providers, "_get_local_constants"):
        yield
        return
    empty = Constants()
    saved = providers._get_local_constants
    # The cache keeps, per kind of draw, the local constants it may pick: drop what it took
    # from the full pool before, and what it takes from the empty one after.
    providers.CONSTANTS_CACHE.cache.clear()
    providers._get_local_constants = lambda: empty
    try:
        yield
    finally:
        providers._get_local_constants = saved
        providers.CONSTANTS_CACHE.cache.clear()


# -- a scripted example: every kind of event the checks need, whatever hypothesis draws ----------

# What the derandomized profile must exercise for its checks to check anything. Generation reaches
# most of these often and some rarely (an abort lands on a waiting request in ~1 of 30 aborts):
# `scripted_example` makes each happen at least once, through the same rules and checks.
COVERAGE = (
    "alone_checked_preempted",
    "alone_checked_chunked",
    "alone_checked_prefix_hit",
    "prompt_logprobs_checked",
    "logprobs_checked",
    "aborts_queued",
    "aborts_waiting",
    "aborts_running",
    "stopped_by_string",
    "stopped_by_token",
    "bad_requests",
    "echo_scored",
)


def plain_spec(**changes) -> Spec:
    """A greedy request of 33 tokens that ignores EOS (its length is known), with ``changes``."""
    values = dict(
        temperature=0.0,
        seed=None,
        top_k=0,
        top_p=1.0,
        min_p=0.0,
        max_tokens=33,
        ignore_eos=True,
        min_tokens=0,
        logprobs=None,
        prompt_logprobs=None,
        stop_ids=(),
        stop_strs=(),
        include_stop=False,
        skip_special=True,
        penalties=False,
        bias=None,
        n=1,
        priority=0,
    )
    values.update(changes)
    return Spec(**values)


def scripted_example(world: FuzzWorld, max_steps: int = 400) -> None:
    """One example of the state machine driven by hand, not by hypothesis, that makes every event
    of COVERAGE happen (a step count that runs out fails it): requests of several pages that
    share a prefix and outgrow the KV pool (chunked, prefix hits, preemption) with logprobs and
    prompt logprobs, stop ids and stop strings taken from their own output, echo scoring, a bad
    request, and aborts of a queued, a waiting and a running request. Every rule, step check and
    end-of-request check is the generated examples' own."""
    machine = machine_class(world)()
    stats = world.stats

    def submit(runs: list[int], loose: list[int], spec: Spec) -> list[str]:
        ids = list(machine.submit(runs, loose, spec).values)
        machine.consistent()
        return ids

    def step_until(done, what: str) -> None:
        for _ in range(max_steps):
            if done():
                return
            machine.step(1)
        machine.fail(f"the scripted example did not reach {what} in {max_steps} steps")

    def with_status(status: RequestStatus) -> str | None:
        """The latest open request in ``status`` (the special ones above go first)."""
        for rid, tracked in reversed(machine.open.items()):
            if tracked.live.request.status is status and tracked.live not in machine.engine._inbox:
                return rid
        return None

    def abort(rid: str | None, kind: str) -> None:
        assert rid is not None
        before = stats[f"aborts_{kind}"]
        machine.abort(rid, False)
        machine.consistent()
        if stats[f"aborts_{kind}"] != before + 1:
            machine.fail(f"the scripted abort of {rid} was not of a {kind} request")

    try:
        # A prompt of 72 tokens (chunked), with logprobs; then, once it is cached, one that
        # starts with it (a prefix hit).
        first = submit([4, 5], [], plain_spec(logprobs=2, prompt_logprobs=1))[0]
        step_until(lambda: machine.open[first].tokens, "the first request's first token")
        submit([4, 5, 0], [9], plain_spec(prompt_logprobs=0))
        # Stop ids and strings picked from the request's own output, and echo scoring.
        submit([2], [], plain_spec(stop_ids=(0.5,)))
        submit([6], [], plain_spec(stop_strs=((0.1, 1), (0.4, 1), (0.7, 1))))
        submit([3], [], plain_spec(max_tokens=0, logprobs=2))
        machine.bad_request("empty", first)
        # More than max_num_seqs long requests: some wait, the pool runs out, some are preempted.
        for runs in ([0, 6, 2], [1, 4, 6], [5, 3, 1], [6, 0, 3], [2, 5], [3, 6, 6]):
            submit(runs, [], plain_spec())
        queued = submit([0, 1], [], plain_spec())[0]
        abort(queued, "queued")
        step_until(lambda: with_status(RequestStatus.WAITING), "a waiting request")
        abort(with_status(RequestStatus.WAITING), "waiting")
        step_until(lambda: with_status(RequestStatus.RUNNING), "a running request")
        abort(with_status(RequestStatus.RUNNING), "running")
        machine.run_until_idle()
        machine.consistent()
    except BaseException:
        machine.broken = True
        raise
    finally:
        machine.teardown()
