"""The request vocabulary shared by every layer: sampling parameters, requests and token events."""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Protocol

from yaied.core.grammar_spec import GrammarSpec

MAX_LOGPROBS = 20  # OpenAI's limit on top_logprobs
LOGIT_BIAS_LIMIT = 100.0  # OpenAI clamps logit_bias values to [-100, 100]
# Bounds on what one request may ask the per-token stop checks to do (OpenAI allows 4 strings).
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
# Below this a temperature is greedy: logits / 1e-40 is inf in fp32, and the row would go NaN.
MIN_TEMPERATURE = 1e-5  # vLLM's _SAMPLING_EPS


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens reached (or the context is full)
    ABORT = "abort"  # the client went away or cancelled
    ERROR = "error"  # the worker failed while running this request


POOLING_MODES = (None, "mean", "last")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """What a client may ask of one generation; validated at construction, never later."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Same seed, same tokens, whatever else shares the batch: a seeded draw's noise is a hash
    # of (seed, number of output tokens so far, token id), computed on the device.
    seed: int | None = None
    # OpenAI penalties on the counts of OUTPUT tokens:
    # logit -= frequency_penalty * count + presence_penalty * (count > 0).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # transformers' rule over prompt + output tokens: positive logits / p, negative logits * p.
    repetition_penalty: float = 1.0
    # Added to the raw logits before anything else. Accepts a dict {token_id: bias}; stored as
    # sorted (token_id, bias) pairs so params stay hashable. Biases are clamped to [-100, 100].
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0  # EOS and stop_token_ids cannot be sampled before this many outputs
    # Top-N alternatives per sampled token (0: the sampled token's logprob only), and per prompt
    # token. Logprobs are the log-softmax of the RAW model logits, before logit_bias, penalties,
    # temperature and top-k/top-p (vLLM's default): they describe the model, not the sampler.
    # For a constrained row they are those of the masked distribution (the grammar's tokens only,
    # renormalised), as vLLM reports them: the grammar is applied before anything else.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # The output must match this (a JSON schema, JSON, a regex, a choice or an EBNF grammar);
    # None: free text. Parsed from the request by yaied/core/grammar_spec.py, compiled before
    # admission, enforced by a per-request matcher and a token mask on the logits.
    structured: GrammarSpec | None = None
    # An embedding, not a generation: run the prompt, return its final hidden states pooled
    # ("mean" over every prompt position, or the "last" position's) in the finishing event's
    # `embedding`, and stop. max_tokens must be 1 (the one sampled token is dropped: no decode).
    pooling: str | None = None

    def __post_init__(self) -> None:
        # Accept lists (and a lone string for stop); store tuples so params stay hashable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        # Deduplicated (in order): the scheduler holds them as a set (Request.stop_ids).
        object.__setattr__(self, "stop_token_ids", tuple(dict.fromkeys(self.stop_token_ids)))
        object.__setattr__(self, "logit_bias", _logit_bias_pairs(self.logit_bias))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        _check(
            isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool),
            "max_tokens must be an integer",
        )
        _check(self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}")
        _check(_finite(self.temperature), "temperature must be a finite number")
        _check(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}")
        _check(_finite(self.top_p), "top_p must be a finite number")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(isinstance(self.top_k, int), "top_k must be an integer")
        _check(self.top_k >= 0, f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        _check(_finite(self.min_p), "min_p must be a finite number")
        _check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings")
        check_stop_strings(self.stop)
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids must be non-negative integers",
        )
        _check(
            len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
            f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, "
            f"got {len(self.stop_token_ids)}",
        )
        self._check_openai_knobs()

    def _check_openai_knobs(self) -> None:
        _check(self.seed is None or _integer(self.seed), "seed must be an integer or None")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_finite(value), f"{name} must be a finite number")
            _check(-2.0 <= value <= 2.0, f"{name} must be in [-2, 2], got {value}")
        _check(_finite(self.repetition_penalty), "repetition_penalty must be a finite number")
        _check(
            self.repetition_penalty > 0.0,
            f"repetition_penalty must be > 0, got {self.repetition_penalty}",
        )
        _check(_integer(self.min_tokens), "min_tokens must be an integer")
        _check(
            0 <= self.min_tokens <= self.max_tokens,
            f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}",
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(
                value is None or (_integer(value) and 0 <= value <= MAX_LOGPROBS),
                f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {value!r}",
            )
        _check(
            self.pooling in POOLING_MODES,
            f"pooling must be None or one of mean, last, got {self.pooling!r}",
        )
        _check(
            self.pooling is None or self.max_tokens == 1,
            "max_tokens must be 1 with pooling (an embedding decodes nothing)",
        )
        _check(
            self.structured is None or isinstance(self.structured, GrammarSpec),
            "structured must be a GrammarSpec (yaied.core.grammar_spec.make_spec) or None",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> SamplingParams:
        """Build from keyword arguments, naming any unknown keyword instead of a TypeError."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(
                f"unknown sampling parameter(s): {', '.join(unknown)}; "
                f"known: {', '.join(sorted(known))}"
            )
        return cls(**kwargs)  # type: ignore[arg-type]


def check_stop_strings(stop: Iterable[str]) -> None:
    """At most MAX_STOP_STRINGS of at most MAX_STOP_STRING_CHARS each: every token's stop check
    costs their total length, on the engine's loop. Shared with the server's early check."""
    stop = list(stop)
    _check(
        len(stop) <= MAX_STOP_STRINGS,
        f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}",
    )
    longest = max(map(len, stop), default=0)
    _check(
        longest <= MAX_STOP_STRING_CHARS,
        f"stop strings may be at most {MAX_STOP_STRING_CHARS} characters, got one of {longest}",
    )


def _finite(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _integer(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _logit_bias_pairs(value: object) -> tuple[tuple[int, float], ...]:
    """A {token_id: bias} mapping (or (id, bias) pairs) as sorted pairs, biases clamped to
    [-100, 100] as OpenAI does. JSON object keys arrive as strings, so decimal strings count as
    ids. Whether an id is below the vocabulary size is the engine's check."""
    items = value.items() if isinstance(value, Mapping) else value
    _check(isinstance(items, Iterable), "logit_bias must map token ids to numbers")
    pairs: dict[int, float] = {}
    for item in items:  # type: ignore[union-attr]
        _check(
            isinstance(item, tuple | list) and len(item) == 2, "logit_bias must map ids to numbers"
        )
        token, bias = item
        if isinstance(token, str) and token.isdecimal():
            token = int(token)
        _check(
            _integer(token) and token >= 0, f"logit_bias keys must be token ids >= 0, got {token!r}"
        )
        _check(_finite(bias), f"logit_bias values must be finite numbers, got {bias!r}")
        pairs[token] = min(max(float(bias), -LOGIT_BIAS_LIMIT), LOGIT_BIAS_LIMIT)
    return tuple(sorted(pairs.items()))


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


class OutputMatcher(Protocol):
    """A constrained request's grammar state (yaied.structured.SequenceMatcher): the scheduler
    advances it with each sampled token. Core names only what the scheduler calls."""

    error: str | None  # why it refused a token; the request then fails alone

    def accept(self, token_id: int) -> bool: ...

    def num_acceptable(self, token_ids: Sequence[int]) -> int: ...

    @property
    def is_terminated(self) -> bool: ...


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be re-admitted
    RUNNING = "running"  # holds pages; prefilling or decoding
    FINISHED = "finished"


@dataclass(slots=True)
class Request:
    """One generation as the scheduler sees it. Mutated only by the engine task.

    Token bookkeeping: ``all_token_ids = prompt + output``; ``num_computed_tokens`` counts the
    tokens whose K/V are in the cache. Prefill and decode follow one rule: computed tokens catch
    up with ``len(all_token_ids)``, the last token's logits giving the next token.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    session_id: str | None = None
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # The page table. Its first num_shared_pages pages belong to the radix cache (locked through
    # prefix_node while this request uses them); the rest are the request's own.
    page_ids: list[int] = field(default_factory=list)
    num_shared_pages: int = 0
    prefix_node: object | None = None
    prefix_counted: bool = False  # its prompt was counted in the cache's query/hit totals
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    first_token_time: float | None = None
    scheduled_time: float | None = None  # first admitted to run (queue time = this - arrival)
    # The EOS ids of the model, fixed at admission; empty when ignore_eos.
    eos_token_ids: frozenset[int] = frozenset()
    # params.structured's grammar state, per sequence like the page table: it has accepted
    # exactly output_token_ids, so a preemption (which keeps them) leaves it valid.
    grammar: OutputMatcher | None = None
    # params.stop_token_ids as a set: checked against every sampled token.
    stop_ids: frozenset[int] = field(init=False)

    def __post_init__(self) -> None:
        self.stop_ids = frozenset(self.params.stop_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, index: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < n else self.output_token_ids[index - n]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass(slots=True)
class TokenLogprobs:
    """One token's log-probability under the raw model distribution, and the top-N alternatives
    (most likely first; empty when N is 0)."""

    token_id: int
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class TokenEvent:
    """One item of a request's stream: new tokens and text, and the finish reason on the last."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    error: str | None = None  # set with FinishReason.ERROR
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    queue_time: float | None = None  # seconds from arrival to first admission, once admitted
    logprobs: list[TokenLogprobs] | None = None  # one per token in token_ids, when asked for
    # On the first event, when asked for: one entry per prompt token (None for the first).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # A pooling request's one (final) event: the pooled hidden state (SamplingParams.pooling).
    embedding: list[float] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """The collected result of one request, as ``LLM.generate`` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
