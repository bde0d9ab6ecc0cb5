"""Running a parsed request on the engine: prompts to jobs, jobs to events, events to responses.

Each choice (prompt x n) is one engine call. Every call is submitted (validated and routed) by
``submit_jobs`` before the response starts, so whatever refuses a call before its first token is
an HTTP status; if one choice is refused, those already submitted are cancelled. Every call's
events go into the response's one EventStream (core/stream.py), tagged with their choice, so
streaming interleaves choices as their tokens arrive; leaving that stream early, for any reason,
cancels the calls that have not finished.

Ids: the client's ``X-Request-Id`` (or one made for it) names the response and is what
``POST /v1/requests/{id}/cancel`` matches, exactly. Calls are keyed by ``request_key``: the
client's id made safe and cut short, then a fresh uuid, so no two requests collide whatever their
clients send; choices add ``-<index>``.

Seeds: choice k of a prompt runs with ``seed + k`` (as vLLM does), so the n choices differ and
the whole response is reproducible; choice 0 is what the same request with n = 1 gives.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from yaied.core.errors import ContextLengthError, InputError
from yaied.core.request import FinishReason, SamplingParams, TokenEvent, TokenLogprobs
from yaied.core.stream import EventSink, EventStream
from yaied.router.calls import Call
from yaied.router.manager import EngineManager, NoEngineAvailable
from yaied.server.chat_output import ChatSettings, ChoiceMessage, output_grammar
from yaied.server.errors import APIError, from_value_error, request_aliases
from yaied.server.limits import RequestLimits
from yaied.server.metrics import RequestTimer, ServerMetrics
from yaied.server.protocol import ParsedRequest
from yaied.server.responses import CompletionLogprobs
from yaied.server.token_text import TokenText

log = logging.getLogger(__name__)

_UNSAFE = re.compile(r"[^A-Za-z0-9._~-]")
_READABLE_LEN = 64


def request_key(client_id: str) -> str:
    """The server's key for one HTTP request: ``<client id>:<uuid4 hex>``, the client's id with
    anything but ``[A-Za-z0-9._~-]`` turned to ``_`` and cut to 64 characters. Unique whatever
    clients send; readable in logs and in the engine (which sees only keys)."""
    return f"{_UNSAFE.sub('_', client_id)[:_READABLE_LEN]}:{uuid.uuid4().hex}"


@dataclass(slots=True)
class Job:
    """One engine request: choice ``index`` of the response, for prompt ``prompt_index``."""

    index: int
    prompt_index: int
    request_id: str  # the call's key (request_key, plus -<index> when there are several)
    prompt_ids: list[int]
    prompt_text: str
    params: SamplingParams
    drop_generated: bool = False  # max_tokens 0: run one token, report none (echo scoring)
    prompt_offsets: list[int] | None = None  # echo's text offsets, found off the loop if large
    output_ids: list[int] = field(default_factory=list)  # resume_token_ids: sent already


@dataclass(slots=True)
class ChoiceState:
    """What one choice has produced so far."""

    job: Job
    echo: bool
    names: TokenText
    completion_logprobs: CompletionLogprobs | None = None
    message: ChoiceMessage | None = None  # chat: the reasoning / content / tool-call parsers
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # sampled, for return_token_ids
    chat_logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_output_tokens: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    seen_event: bool = False

    def update(self, event: TokenEvent) -> tuple[str, list[TokenLogprobs]]:
        """Record an event; the new text and token logprobs it brings (echo on the first)."""
        prefix = ""
        if not self.seen_event:
            self.seen_event = True
            if self.echo:
                prefix = self.job.prompt_text
                if self.completion_logprobs is not None:
                    offsets = self.job.prompt_offsets
                    if offsets is None:
                        offsets = self.names.prompt_offsets(self.job.prompt_ids, prefix)
                    self.completion_logprobs.add_prompt(
                        self.job.prompt_ids, event.prompt_logprobs or [], offsets
                    )
        text, lps = event.text, list(event.logprobs or [])
        if self.job.drop_generated:
            text, lps = "", []
        else:
            self.num_output_tokens = event.num_output_tokens
            self.token_ids.extend(event.token_ids)
        if self.completion_logprobs is not None:
            for lp in lps:
                self.completion_logprobs.add(lp.token_id, lp)
        self.chat_logprobs.extend(lps)
        self.text.append(prefix + text)
        # known from the first token on (a stream's message_start reports it); final at the end
        self.num_cached_tokens = event.num_cached_tokens
        if event.finished:
            self.num_prompt_tokens = event.num_prompt_tokens
            self.finish_reason = event.finish_reason.value
            self.stop_reason = event.stop_reason
            if self.job.drop_generated and event.finish_reason is not FinishReason.ERROR:
                self.finish_reason, self.stop_reason = "length", None
        return prefix + text, lps


def build_jobs(
    manager: EngineManager,
    parsed: ParsedRequest,
    base_id: str,
    chat_template: str = "",
    limits: RequestLimits | None = None,
    chat: ChatSettings | None = None,
) -> list[Job]:
    """Tokenize and validate every prompt before anything is queued: a bad one is a 400. A chat
    request's output constraint is settled here too (`output_grammar`): with tools or reasoning
    it depends on the rendered prompt."""
    limits = limits or RequestLimits()
    aliases = request_aliases(parsed.kind)
    aliases["prompt"] = "messages" if parsed.kind == "chat" else "prompt"
    chat = chat or ChatSettings()
    try:
        prompts = _tokenized_prompts(manager, parsed, chat_template, chat)
        if parsed.kind == "chat":
            own = parsed.structured
            parsed.structured = output_grammar(parsed, chat, prompts[0][1])
            parsed.own_structured = own if parsed.structured is not own else None
        jobs = []
        for prompt_index, (ids, text) in enumerate(prompts):
            limits.check_prompt(len(ids), aliases["prompt"])
            params, drop = _params_for(manager, parsed, len(ids), limits)
            if drop and len(ids) >= manager.info.max_model_len:
                raise ContextLengthError(
                    f"prompt ({len(ids)} tokens) fills the model's context length of "
                    f"{manager.info.max_model_len} tokens: with max_tokens 0 the prompt is scored "
                    f"by running one token past it, so it may hold at most "
                    f"{manager.info.max_model_len - 1} tokens"
                )
            manager.inputs.check_fits(len(ids), params.max_tokens)
            for k in range(parsed.n):
                index = len(jobs)
                own = params if params.seed is None else _with_seed(params, params.seed + k)
                jobs.append(Job(index, prompt_index, base_id, ids, text, own, drop))
        if parsed.resume_token_ids:  # protocol.py allows it with one prompt and n 1 only
            jobs[0].output_ids = _resumed(manager, parsed.resume_token_ids, jobs[0].params)
    except ValueError as exc:
        raise from_value_error(exc, aliases) from None
    if len(jobs) > 1:
        for job in jobs:
            job.request_id = f"{base_id}-{job.index}"
    return jobs


def _resumed(manager: EngineManager, ids: list[int], params: SamplingParams) -> list[int]:
    """A router's resume_token_ids, checked: token ids, fewer than max_tokens."""
    vocab = manager.info.vocab_size
    if not all(0 <= token < vocab for token in ids):
        raise InputError(f"resume_token_ids must be token ids in [0, {vocab})", "resume_token_ids")
    if len(ids) >= params.max_tokens:
        raise InputError(
            f"resume_token_ids must be fewer than max_tokens ({params.max_tokens})",
            "resume_token_ids",
        )
    return list(ids)


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    return dataclasses.replace(params, seed=seed)


def _tokenized_prompts(
    manager: EngineManager, parsed: ParsedRequest, chat_template: str, chat: ChatSettings
) -> list[tuple[list[int], str]]:
    tokenizer = manager.tokenizer
    if parsed.kind == "chat":
        ids, text = manager.inputs.chat_prompt(
            parsed.messages,
            chat_template,
            add_generation_prompt=parsed.add_generation_prompt,
            continue_final_message=parsed.continue_final_message,
            template_kwargs=parsed.chat_template_kwargs,
            tools=parsed.tools.definitions() or None,
            tool_format=chat.tool_format,
        )
        return [(ids, text)]
    out = []
    # The real max_tokens is checked once params exist; the probe's names the client's in the
    # message of a prompt that cannot fit. With max_tokens 0 it checks the prompt alone (as an
    # embedding's is): the room for the one token scoring runs is checked with the params.
    if parsed.max_tokens == 0:
        probe = SamplingParams(max_tokens=1, pooling="last")
    else:
        probe = SamplingParams(max_tokens=max(parsed.max_tokens or 1, 1))
    names = TokenText.of(tokenizer)
    for prompt in parsed.prompts:
        ids = manager.inputs.prompt_token_ids(prompt, probe)
        if isinstance(prompt, str):
            text = prompt
        else:  # echo shows it as logprobs' text offsets count it
            text = names.decode_prompt(ids) if parsed.echo else ""
        out.append((ids, text))
    return out


def _params_for(
    manager: EngineManager, parsed: ParsedRequest, num_prompt_tokens: int, limits: RequestLimits
) -> tuple[SamplingParams, bool]:
    max_tokens = parsed.max_tokens
    if max_tokens is None:  # chat's default: whatever the context has left, under the cap
        max_tokens = limits.default_max_tokens(manager.room_for(num_prompt_tokens))
        if max_tokens < 1:
            raise ContextLengthError(
                f"prompt ({num_prompt_tokens} tokens) fills the model's context length of "
                f"{manager.info.max_model_len} tokens"
            )
    elif parsed.max_tokens_to_context:
        room = manager.room_for(num_prompt_tokens)
        if room < 1:  # the prompt's fault alone: the client's max_tokens would be cut anyway
            raise ContextLengthError(
                f"prompt ({num_prompt_tokens} tokens) fills the model's context length of "
                f"{manager.info.max_model_len} tokens"
            )
        max_tokens = min(max_tokens, room)
    # Completions with max_tokens 0 (echo scoring in eval harnesses): run one token for the
    # prompt's logprobs and report none. Chat has no use for it; SamplingParams refuses 0 there.
    drop = max_tokens == 0 and parsed.kind == "completion"
    sampling: dict[str, Any] = dict(parsed.sampling, max_tokens=1 if drop else max_tokens)
    if drop and sampling.get("min_tokens"):
        raise ValueError("min_tokens must be 0 when max_tokens is 0")
    if parsed.structured is not None:
        sampling["structured"] = parsed.structured
    if parsed.logprobs is not None:
        sampling["logprobs"] = parsed.logprobs
        if parsed.echo:
            sampling["prompt_logprobs"] = parsed.logprobs
    return manager.inputs.sampling_params(None, sampling), drop


class _JobSink:
    """One call's sink: metrics and the log line, then the response's one stream."""

    def __init__(self, job: Job, timer: RequestTimer, client_id: str, put: EventSink) -> None:
        self.job = job
        self.timer = timer
        self.client_id = client_id
        self.put = put
        self.call: Call | None = None  # set once started (events can come before: a refusal)

    def __call__(self, event: TokenEvent) -> None:
        timer = self.timer
        if self.call is not None:
            timer.engine = self.call.engine_id  # routed (or retried) there
        timer.on_event(event)
        if event.finished:
            _log_request(self.client_id, self.job.request_id, event, timer)
        self.put(event)


@dataclass(slots=True)
class Submitted:
    """The calls of one HTTP request, and the one stream all their events arrive on."""

    manager: EngineManager
    events: EventStream[Job]
    calls: list[tuple[Job, Call, RequestTimer]] = field(default_factory=list)

    def cancel_nowait(self) -> None:
        """Cancel every call that has not finished (the stream's reader left early)."""
        for _, call, _ in self.calls:
            if not call.finished:
                self.manager.cancel_nowait(call.request_id)

    async def cancel_unfinished(self) -> None:
        """Cancel every call of a response that has not finished (a no-op for those that have).
        Run however the response ended: the guard for a stream that never started reading its
        calls (a client gone before the headers went out)."""
        for _, call, _ in self.calls:
            if not call.finished:
                # Its final abort event still comes through the sink (the engine sends one for
                # every call), so the metrics count the tokens it generated before the cancel.
                await self.manager.cancel_request(call.request_id)


def submit_jobs(
    manager: EngineManager,
    jobs: list[Job],
    metrics: ServerMetrics,
    *,
    client_id: str,
    session_id: str | None,
    priority: int,
    via: tuple[str, ...] = (),
) -> Submitted:
    """Route and start every job's call (validated by build_jobs) before anything is sent to the
    client: a refusal is an APIError (503 when no engine can take the call), and the calls
    already started are cancelled. Their events all go to one stream, tagged with their job."""
    submitted: Submitted = Submitted(manager, EventStream(len(jobs)))
    submitted.events = EventStream(len(jobs), on_close=submitted.cancel_nowait)
    try:
        for job in jobs:
            timer = metrics.timer()
            timer.num_generated_before = len(job.output_ids)
            sink = _JobSink(job, timer, client_id, submitted.events.sink(job))
            sink.call = manager.start_call(
                job.prompt_ids,
                job.params,
                sink=sink,
                session_id=session_id,
                priority=priority,
                request_id=job.request_id,
                client_id=client_id,
                output_ids=job.output_ids,
                via=via,
            )
            submitted.calls.append((job, sink.call, timer))
    except BaseException as exc:
        submitted.cancel_nowait()
        if isinstance(exc, NoEngineAvailable):
            raise APIError(503, str(exc), code="engine_not_ready") from None
        if isinstance(exc, ValueError):
            raise from_value_error(exc) from None
        raise
    return submitted


def _log_request(client_id: str, key: str, event: TokenEvent, timer: RequestTimer) -> None:
    """The one log line per finished call: the client's id, then the call's key."""
    now = time.monotonic()
    ttft = "-" if timer.first is None else f"{timer.first - timer.start:.3f}s"
    log.info(
        "request %s (%s): %s, prompt %d tokens (%d cached), output %d, ttft %s, total %.3fs%s",
        client_id,
        key,
        event.finish_reason,
        event.num_prompt_tokens,
        event.num_cached_tokens,
        event.num_output_tokens,
        ttft,
        now - timer.start,
        f", error: {event.error}" if event.error else "",
    )


def total_usage(choices: list[ChoiceState]) -> tuple[int, int, int]:
    """(prompt, completion, cached) tokens; a prompt counts once however many choices it has."""
    prompt = cached = completion = 0
    seen: set[int] = set()
    for choice in choices:
        completion += choice.num_output_tokens
        if choice.job.prompt_index not in seen:
            seen.add(choice.job.prompt_index)
            prompt += len(choice.job.prompt_ids)
            cached += choice.num_cached_tokens
    return prompt, completion, cached


def new_choices(
    jobs: list[Job], parsed: ParsedRequest, names: TokenText, chat: ChatSettings | None = None
) -> list[ChoiceState]:
    legacy = parsed.kind == "completion" and parsed.logprobs is not None
    choices = []
    for job in jobs:
        logprobs = message = None
        if legacy:
            base = len(job.prompt_text) if parsed.echo else 0
            offsets = names.output_offsets(job.prompt_ids, job.params.skip_special_tokens, base)
            logprobs = CompletionLogprobs(names, offsets)
        if parsed.kind == "chat":
            message = ChoiceMessage(chat or ChatSettings(), parsed.tools, job.prompt_text)
        choices.append(ChoiceState(job, parsed.echo, names, logprobs, message))
    return choices
