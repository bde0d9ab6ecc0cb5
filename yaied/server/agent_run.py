"""Running an agent API's request (Responses, Messages) as the one chat choice it is underneath.

Each agent API parses its body into a chat `ParsedRequest` (messages, tools, constraint and
sampling fields from the one table), then comes here: the same limits, jobs, grammar compile,
queue check and submission as /v1/chat/completions (server/generate.py), so every refusal is
an HTTP status decided before the response starts and nothing reaches the engine unchecked.
`AgentRun.deltas` yields the chat deltas of the choice's parsers (reasoning, content, tool
calls), which agent_output.Blocks turns into each API's blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.requests import Request

from yaied.core.request import FinishReason, TokenEvent, TokenLogprobs
from yaied.router.manager import EngineManager
from yaied.server.admission import prepare_jobs, request_size
from yaied.server.auth import api_key_of, may_set_priority
from yaied.server.errors import APIError, public_error
from yaied.server.generate import _compile_grammar, unless_gone
from yaied.server.keys import scoped_id
from yaied.server.limits import RequestLimits
from yaied.server.protocol import ParsedRequest
from yaied.server.serving import (
    ChoiceState,
    Job,
    Submitted,
    new_choices,
    request_key,
    submit_jobs,
)
from yaied.server.state import ServerState
from yaied.server.token_text import TokenText

T = TypeVar("T")


class ClientGone(Exception):
    """The client left while its request was prepared or collected: answer nobody (499)."""


ABORTED = "the call was aborted before it finished"


def abort_error(server: ServerState) -> APIError:
    """What a call the engine aborted (a cancel through the router, the drain's abort on a
    stop) ends with where an API cannot end it as a reply: a 503 while the server drains (the
    client may retry, elsewhere or after the restart), else a 500 the client must not retry (a
    cancel is deliberate; a retry would run the call again)."""
    if server.draining:
        headers = {"Retry-After": str(server.config.retry_after_seconds)}
        return APIError(503, f"the server is shutting down: {ABORTED}", code="draining",
                        headers=headers)  # fmt: skip
    return APIError(500, ABORTED, code="cancelled", headers={"x-should-retry": "false"})


@dataclass(slots=True)
class AgentRun:
    choice: ChoiceState
    started: Submitted
    request_id: str
    # the sampled tokens' logprobs (when asked for) that no delta has carried yet
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)

    @property
    def usage(self) -> tuple[int, int, int]:
        """(prompt, output, cached) tokens."""
        c = self.choice
        return len(c.job.prompt_ids), c.num_output_tokens, c.num_cached_tokens

    async def deltas(self) -> AsyncIterator[list[dict[str, Any]]]:
        """The choice's chat deltas as the engine's events arrive (the last batch after its
        final event); an engine failure is a 500 APIError."""
        choice, message = self.choice, self.choice.message
        assert message is not None
        events = self.started.events.events()
        async with contextlib.aclosing(events):
            async for _, event in events:
                if event.finish_reason is FinishReason.ERROR:
                    text = public_error("generation failed", event.error, self.request_id)
                    raise APIError(500, text, code="engine_error")
                text, logprobs = choice.update(event)
                self.new_logprobs.extend(logprobs)
                out = message.feed(text) if text else []
                if event.finished:
                    out += message.finish()
                yield out


async def start_chat(
    request: Request,
    server: ServerState,
    manager: EngineManager,
    parsed: ParsedRequest,
    request_id: str,
    *,
    session_id: str | None,
    max_tokens_name: str,
    prompt_name: str = "messages",
) -> AgentRun:
    """Check, tokenize, compile and submit one chat choice; ``session_id`` is the client's (it is
    put in the caller's key's namespace here). ``max_tokens_name``, ``prompt_name``: the API's
    names for max_tokens and for the messages."""
    limits = RequestLimits.from_config(server.config)
    asked = {"max_tokens": parsed.max_tokens} if parsed.max_tokens is not None else {}
    chat = server.chat_settings(manager)
    size = request_size(parsed)
    key, template = request_key(request_id), server.config.chat_template
    try:
        limits.check_parsed(parsed, {"user": parsed.user, **asked})
        jobs = await server.off_loop(
            size, prepare_jobs, manager, parsed, key, template, limits, chat
        )
    except APIError as exc:
        raise _named(exc, max_tokens_name, prompt_name) from None
    if not await _compile_grammar(manager, parsed, request):
        raise ClientGone
    server.check_queue(manager, len(jobs))
    api_key = api_key_of(request)
    started = submit_jobs(
        manager,
        jobs,
        server.metrics,
        client_id=scoped_id(api_key, request_id),
        session_id=None if session_id is None else scoped_id(api_key, session_id),
        priority=parsed.priority if may_set_priority(request) else 0,
    )
    choice = new_choices(jobs, parsed, TokenText.of(manager.tokenizer), chat)[0]
    return AgentRun(choice, started, request_id)


def _named(exc: APIError, max_tokens_name: str, prompt_name: str) -> APIError:
    """``exc`` in the API's words: the limits and the engine's checks speak chat's max_tokens
    (param max_completion_tokens or max_tokens) and messages, the client sent
    ``max_tokens_name`` and ``prompt_name``."""
    if exc.param in ("max_tokens", "max_completion_tokens"):
        exc.param = max_tokens_name
    elif exc.param == "messages":
        exc.param = prompt_name
    if exc.param == max_tokens_name or exc.code == "context_length_exceeded":
        exc.message = exc.message.replace("max_tokens", max_tokens_name)
    return exc


async def collect(request: Request, started: Submitted, work: Callable[[], Awaitable[T]]) -> T:
    """``work()`` (which reads the calls' events) unless the client leaves first: then the calls
    are cancelled within one engine step and ClientGone raised."""
    task = asyncio.ensure_future(work())
    try:
        await unless_gone(request, task)
    finally:
        await started.cancel_unfinished()
    if task.cancelled():
        raise ClientGone
    return task.result()


async def collect_events(
    request: Request, started: Submitted, take: Callable[[Job, TokenEvent], None]
) -> None:
    """Every final event of the calls to ``take`` (which may raise an APIError), unless the
    client leaves first (ClientGone)."""

    async def work() -> None:
        events = started.events.events()
        async with contextlib.aclosing(events):
            async for job, event in events:
                if event.finished:
                    take(job, event)

    await collect(request, started, work)
