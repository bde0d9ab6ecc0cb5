"""Running a parsed request on the engine: prompts to jobs, jobs to events, events to responses.

Each choice (prompt x n) is one engine request, run by its own pump task into one queue, so
streaming interleaves choices as their tokens arrive. Closing the merged iterator cancels the
pumps, which closes their engine streams and so aborts their requests: that is the only
cancellation path, whether the client left, a choice failed or the response was complete.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from yaied.request import FinishReason, SamplingParams, TokenEvent, TokenLogprobs
from yaied.router.manager import EngineManager, NoEngineAvailable
from yaied.server.errors import APIError, from_value_error
from yaied.server.limits import RequestLimits
from yaied.server.metrics import RequestTimer, ServerMetrics
from yaied.server.protocol import ParsedRequest
from yaied.server.responses import CompletionLogprobs, TokenText

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Job:
    """One engine request: choice ``index`` of the response, for prompt ``prompt_index``."""

    index: int
    prompt_index: int
    request_id: str
    prompt_ids: list[int]
    prompt_text: str
    params: SamplingParams
    drop_generated: bool = False  # max_tokens 0: run one token, report none (echo scoring)


@dataclass(slots=True)
class ChoiceState:
    """What one choice has produced so far."""

    job: Job
    echo: bool
    token_text: TokenText
    completion_logprobs: CompletionLogprobs | None = None
    text: list[str] = field(default_factory=list)
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
                    self.completion_logprobs.add_prompt(
                        self.job.prompt_ids, event.prompt_logprobs or []
                    )
        text, lps = event.text, list(event.logprobs or [])
        if self.job.drop_generated:
            text, lps = "", []
        else:
            self.num_output_tokens = event.num_output_tokens
        if self.completion_logprobs is not None:
            for lp in lps:
                self.completion_logprobs.add(lp.token_id, lp)
        self.chat_logprobs.extend(lps)
        self.text.append(prefix + text)
        if event.finished:
            self.num_prompt_tokens = event.num_prompt_tokens
            self.num_cached_tokens = event.num_cached_tokens
            self.finish_reason = event.finish_reason.value
            self.stop_reason = event.stop_reason
            if self.job.drop_generated and event.finish_reason is not FinishReason.ERROR:
                self.finish_reason, self.stop_reason = "length", None
        return prefix + text, lps


def chat_prompt_text(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    chat_template: str = "",
    param: str | None = None,
) -> str:
    """The messages through ``chat_template`` (server.chat_template), else the tokenizer's own."""
    if tokenizer is None or not (chat_template or getattr(tokenizer, "chat_template", None)):
        raise APIError(400, "this model has no chat template; use /v1/completions", param=param)
    from jinja2 import TemplateError  # transformers renders templates with jinja2

    try:
        return tokenizer.apply_chat_template(
            messages,
            chat_template=chat_template or None,
            tokenize=False,
            add_generation_prompt=True,
        )
    except TemplateError as exc:  # a template's raise_exception, say for roles out of order
        raise APIError(400, f"chat template: {exc}", param="messages") from None


def build_jobs(
    engine: EngineManager,
    parsed: ParsedRequest,
    base_id: str,
    chat_template: str = "",
    limits: RequestLimits | None = None,
) -> list[Job]:
    """Tokenize and validate every prompt before anything is queued: a bad one is a 400."""
    limits = limits or RequestLimits()
    aliases = {"max_tokens": "max_completion_tokens"} if parsed.kind == "chat" else {}
    aliases["prompt"] = "messages" if parsed.kind == "chat" else "prompt"
    if parsed.kind == "chat":
        aliases["logprobs"] = "top_logprobs"
    try:
        prompts = _tokenized_prompts(engine, parsed, chat_template)
        jobs = []
        for prompt_index, (ids, text) in enumerate(prompts):
            limits.check_prompt(len(ids), aliases["prompt"])
            params, drop = _params_for(engine, parsed, len(ids), limits)
            engine.inputs.prompt_token_ids(ids, params)  # the context-length check
            for _ in range(parsed.n):
                index = len(jobs)
                jobs.append(Job(index, prompt_index, base_id, ids, text, params, drop))
    except ValueError as exc:
        raise from_value_error(exc, aliases) from None
    if len(jobs) > 1:
        for job in jobs:
            job.request_id = f"{base_id}-{job.index}"
    return jobs


def _tokenized_prompts(
    engine: EngineManager, parsed: ParsedRequest, chat_template: str
) -> list[tuple[list[int], str]]:
    tokenizer = engine.tokenizer
    if parsed.kind == "chat":
        text = chat_prompt_text(tokenizer, parsed.messages, chat_template)
        # The template wrote the special tokens already; adding them again doubles a BOS.
        return [(tokenizer.encode(text, add_special_tokens=False), text)]
    out = []
    probe = SamplingParams(max_tokens=1)  # the real max_tokens is checked once params exist
    for prompt in parsed.prompts:
        ids = engine.inputs.prompt_token_ids(prompt, probe)
        if isinstance(prompt, str):
            text = prompt
        else:
            text = tokenizer.decode(ids) if tokenizer is not None else ""
        out.append((ids, text))
    return out


def _params_for(
    engine: EngineManager, parsed: ParsedRequest, num_prompt_tokens: int, limits: RequestLimits
) -> tuple[SamplingParams, bool]:
    max_tokens = parsed.max_tokens
    if max_tokens is None:  # chat's default: whatever the context has left, under the cap
        max_tokens = limits.default_max_tokens(engine.info.max_model_len - num_prompt_tokens)
        if max_tokens < 1:
            raise ValueError(
                f"prompt ({num_prompt_tokens} tokens) fills the model's context length of "
                f"{engine.info.max_model_len} tokens"
            )
    # Completions with max_tokens 0 (echo scoring in eval harnesses): run one token for the
    # prompt's logprobs and report none. Chat has no use for it; SamplingParams refuses 0 there.
    drop = max_tokens == 0 and parsed.kind == "completion"
    sampling: dict[str, Any] = dict(parsed.sampling, max_tokens=1 if drop else max_tokens)
    if drop and sampling.get("min_tokens"):
        raise ValueError("min_tokens must be 0 when max_tokens is 0")
    if parsed.logprobs is not None:
        sampling["logprobs"] = parsed.logprobs
        if parsed.echo:
            sampling["prompt_logprobs"] = parsed.logprobs
    return engine.inputs.sampling_params(None, sampling), drop


async def run_jobs(
    engine: EngineManager,
    jobs: list[Job],
    metrics: ServerMetrics,
    *,
    session_id: str | None,
    priority: int,
) -> AsyncIterator[tuple[Job, TokenEvent]]:
    """The events of every job, interleaved as they come; closing this aborts the unfinished."""
    queue: asyncio.Queue[tuple[Job, TokenEvent | BaseException]] = asyncio.Queue()

    async def pump(job: Job) -> None:
        timer = metrics.timer()
        stream = None
        try:
            handle = await engine.submit_request(
                session_id=session_id,
                prompt=job.prompt_ids,
                sampling_params=job.params,
                priority=priority,
                request_id=job.request_id,
            )
            stream = handle.stream()
            async for event in stream:
                timer.engine = handle.engine_id  # routed (or retried) there
                timer.on_event(event)
                queue.put_nowait((job, event))
                if event.finished:
                    _log_request(job.request_id, event, timer)
        except Exception as exc:  # e.g. a request id already in use: report, don't hang
            queue.put_nowait((job, exc))
        finally:
            if stream is not None:
                await stream.aclose()  # cancels the call unless it finished
            timer.finish(FinishReason.ABORT.value, len(job.prompt_ids), 0)  # no-op if finished

    tasks = [asyncio.create_task(pump(job), name=f"yaied-{job.request_id}") for job in jobs]
    try:
        remaining = len(jobs)
        while remaining:
            job, item = await queue.get()
            if isinstance(item, BaseException):
                if isinstance(item, ValueError):
                    raise from_value_error(item)
                if isinstance(item, NoEngineAvailable):
                    raise APIError(503, str(item), code="engine_not_ready")
                raise item
            remaining -= item.finished
            yield job, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _log_request(request_id: str, event: TokenEvent, timer: RequestTimer) -> None:
    """The one log line per finished request."""
    now = time.monotonic()
    ttft = "-" if timer.first is None else f"{timer.first - timer.start:.3f}s"
    log.info(
        "request %s: %s, prompt %d tokens (%d cached), output %d, ttft %s, total %.3fs%s",
        request_id,
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


def new_choices(jobs: list[Job], parsed: ParsedRequest, token_text: TokenText) -> list[ChoiceState]:
    legacy = parsed.kind == "completion" and parsed.logprobs is not None
    return [
        ChoiceState(
            job, parsed.echo, token_text, CompletionLogprobs(token_text) if legacy else None
        )
        for job in jobs
    ]
