"""The two generation endpoints: /v1/completions and /v1/chat/completions.

Both parse, build jobs, compile the request's grammar if it has one, and submit the jobs (every
refusal, 4xx or 503, is decided here, before the response starts), then either stream SSE chunks
or collect the events into one body. A
non-streaming client that leaves is noticed by a watcher on the ASGI receive channel, which
cancels the collection and so aborts its requests within one engine step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from sse_starlette import EventSourceResponse
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from yaied.core.grammar_spec import StructuredOutputError
from yaied.core.request import FinishReason
from yaied.router.manager import EngineManager
from yaied.server import responses as R
from yaied.server.admission import prepare_jobs, request_size
from yaied.server.auth import api_key_of, may_set_priority
from yaied.server.body import read_json
from yaied.server.chat_output import output_refused
from yaied.server.chat_protocol import parse_chat
from yaied.server.errors import (
    APIError,
    error_body,
    from_value_error,
    json_response,
    public_error,
)
from yaied.server.hops import via_of
from yaied.server.keys import scoped_id
from yaied.server.limits import RequestLimits
from yaied.server.protocol import ParsedRequest, parse_completion
from yaied.server.serving import (
    ChoiceState,
    Job,
    new_choices,
    request_key,
    submit_jobs,
    total_usage,
)
from yaied.server.state import ServerState
from yaied.server.token_text import TokenText

log = logging.getLogger(__name__)
DONE = b"data: [DONE]\n\n"


async def completions(request: Request) -> Response:
    return await _generate(request, "completion")


async def chat_completions(request: Request) -> Response:
    return await _generate(request, "chat")


async def _generate(request: Request, kind: str) -> Response:

    server: ServerState = request.state.server
    prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
    # The client's id names the response and is what cancel matches; calls are keyed apart.
    request_id = request.headers.get("x-request-id") or prefix + uuid.uuid4().hex
    request.state.request_id = request_id
    manager = server.ready_manager()
    body = await read_json(request)
    parsed = parse_chat(body) if kind == "chat" else parse_completion(body)
    server.check_model(parsed.model)
    limits = RequestLimits.from_config(server.config)
    limits.check_parsed(parsed, body)
    key = request_key(request_id)
    chat = server.chat_settings(manager)
    template = server.config.chat_template
    jobs = await server.off_loop(
        request_size(parsed), prepare_jobs, manager, parsed, key, template, limits, chat
    )
    if not await _compile_grammar(manager, parsed, request):
        log.info("%s: client disconnected while its grammar compiled", request_id)
        return Response(status_code=499)  # nothing was queued
    server.check_queue(manager, len(jobs))
    head = R.ResponseHead(request_id, int(time.time()), server.model_name)
    session_id = request.headers.get("x-session-id") or parsed.user
    # With API keys, ids live in the caller's key's namespace: no key reaches another's work.
    api_key = api_key_of(request)
    session_id = None if session_id is None else scoped_id(api_key, session_id)
    choices = new_choices(jobs, parsed, TokenText.of(manager.tokenizer), chat)
    headers = {"X-Request-Id": request_id}
    # The calls start here: from now on, however the response ends, cancel_unfinished runs.
    started = submit_jobs(
        manager,
        jobs,
        server.metrics,
        client_id=scoped_id(api_key, request_id),
        session_id=session_id,
        priority=parsed.priority if may_set_priority(request) else 0,
        via=via_of(request.headers),  # the daemons it came through, when forwarded to us
    )
    events = started.events.events()
    if parsed.stream:
        stream = _sse(parsed, head, choices, events)
        return _SSEResponse(
            stream,
            started.cancel_unfinished,
            headers=headers,
            sep="\n",
            ping=server.config.sse_ping_seconds,
        )
    collect = asyncio.create_task(_collect(parsed, head, choices, events))
    watch = asyncio.create_task(_wait_for_disconnect(request))
    try:
        await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not collect.done():  # the client left (or we were cancelled): abort its requests
            collect.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await collect
        await started.cancel_unfinished()  # collect may have been cancelled before it started
    if collect.cancelled():
        log.info("%s: client disconnected; aborted", request_id)
        return Response(status_code=499)  # nobody reads it; the access log shows why
    return json_response(collect.result(), headers=headers)


class _SSEResponse(EventSourceResponse):
    """SSE whose calls are cancelled however the response ends, even when its stream never
    started (the client left before the headers went out, so nothing closed the stream)."""

    def __init__(
        self, content: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]], **kwargs: Any
    ) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


async def _compile_grammar(manager: EngineManager, parsed: ParsedRequest, request: Request) -> bool:
    """Compile the request's grammar before anything is queued, off the event loop (at once on a
    cache hit): a spec that does not compile, or not within the compile timeout, is a 400 naming
    its field. False when the client left first: then no call starts, and the compile is
    dropped unless it runs already or another request waits for it (then it lands in the cache)."""
    spec, grammars = parsed.structured, manager.inputs.grammars
    if spec is None:
        return True
    if grammars.cached(spec) is not None:
        _check_resumed(manager, parsed)
        return True
    compiling = asyncio.ensure_future(grammars.compile(spec))
    await unless_gone(request, compiling)
    if compiling.cancelled():
        return False
    exc = compiling.exception()
    if isinstance(exc, StructuredOutputError) and (parsed.tools.active or parsed.own_structured):
        raise await output_refused(grammars, parsed, exc) from None  # which part's
    if isinstance(exc, ValueError):  # StructuredOutputError: names the field at fault
        raise from_value_error(exc) from None
    if exc is not None:
        raise exc
    _check_resumed(manager, parsed)
    return True


def _check_resumed(manager: EngineManager, parsed: ParsedRequest) -> None:
    """A resumed call's tokens (resume_token_ids) must be ones its grammar allows: the engine
    replays them through the grammar, and a refused one would fail the call there, a 500 or an
    error event, for what is bad input."""
    if not parsed.resume_token_ids or parsed.structured is None:
        return
    grammars = manager.inputs.grammars
    compiled = grammars.cached(parsed.structured, count=False)
    if compiled is None:
        return  # evicted already: the engine compiles it again and checks the replay
    matcher = grammars.matcher_of(compiled)
    if not matcher.accept_tokens(parsed.resume_token_ids):
        raise APIError(400, f"resume_token_ids: {matcher.error}", param="resume_token_ids")


async def unless_gone(request: Request, task: asyncio.Future) -> None:
    """Wait for ``task`` unless the client leaves first: then it is cancelled (and waited for,
    so nothing it holds outlives this)."""
    watch = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(
    parsed: ParsedRequest,
    head: R.ResponseHead,
    choices: list[ChoiceState],
    events: AsyncIterator[tuple[Job, Any]],
) -> dict[str, Any]:
    async with contextlib.aclosing(events):
        async for job, event in events:
            if event.finish_reason is FinishReason.ERROR:
                message = public_error("generation failed", event.error, head.id)
                raise APIError(500, message, code="engine_error")
            choices[job.index].update(event)
    out = []
    for c in choices:
        text, index = "".join(c.text), c.job.index
        if c.message is not None:  # chat
            lps = None
            if parsed.logprobs is not None:
                lps = R.chat_logprobs(c.names, c.chat_logprobs)
            c.message.feed(text)
            c.message.finish()
            finish = c.message.finish_reason(c.finish_reason)
            message = c.message.message()
            out.append(R.chat_message_choice(index, message, lps, finish, c.stop_reason))
        else:
            lps = None if c.completion_logprobs is None else c.completion_logprobs.take()
            item = R.completion_choice(index, text, lps, c.finish_reason, c.stop_reason)
            if parsed.return_token_ids:  # as streamed: the sampled ids, never the prompt's
                item["token_ids"] = c.token_ids
            out.append(item)
    kind = "chat.completion" if parsed.kind == "chat" else "text_completion"
    return R.response_body(head, kind, out, R.usage_body(*total_usage(choices)))


def _data(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


async def _sse(
    parsed: ParsedRequest,
    head: R.ResponseHead,
    choices: list[ChoiceState],
    events: AsyncIterator[tuple[Job, Any]],
) -> AsyncIterator[bytes]:
    """SSE exactly as OpenAI sends it; after the first byte, errors travel as an error chunk."""
    chat = parsed.kind == "chat"
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(items: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        body = R.response_body(head, kind, items, usage)
        if not parsed.include_usage:
            del body["usage"]
        return _data(body)

    async with contextlib.aclosing(events):
        try:
            if chat:  # OpenAI opens each choice with the role and empty content
                delta = {"role": "assistant", "content": ""}
                yield chunk([R.chat_delta_choice(c.job.index, delta, None, None) for c in choices])
            async for job, event in events:
                if event.finish_reason is FinishReason.ERROR:
                    message = public_error("generation failed", event.error, head.id)
                    yield _data(error_body(500, message, code="engine_error"))
                    break
                for item in _choice_chunks(parsed, choices[job.index], event):
                    yield chunk([item])
            else:
                if parsed.include_usage:
                    yield chunk([], R.usage_body(*total_usage(choices)))
        except APIError as exc:
            yield _data(exc.body())
        except Exception:
            log.exception("%s: stream failed", head.id)
            message = f"stream failed; the server log has it under request id {head.id}"
            yield _data(error_body(500, message))
    yield DONE


def _choice_chunks(parsed: ParsedRequest, choice: ChoiceState, event: Any) -> list[dict[str, Any]]:
    """The chunks one event makes: none while the detokenizer or a parser holds text back;
    chat may make several (reasoning, content and a tool call, in the order they were written)."""
    text, lps = choice.update(event)
    finish = choice.finish_reason if event.finished else None
    index = choice.job.index
    if choice.message is not None:  # chat
        deltas = choice.message.feed(text) if text else []
        if finish is not None:
            deltas += choice.message.finish()
            finish = choice.message.finish_reason(finish)
        if not deltas and (lps or finish is not None):
            deltas = [{}]  # logprobs of held-back text, or the finish, still go out
        logprobs = R.chat_logprobs(choice.names, lps) if parsed.logprobs is not None else None
        last = len(deltas) - 1
        return [
            R.chat_delta_choice(
                index, delta, logprobs if k == 0 else None, finish if k == last else None
            )
            for k, delta in enumerate(deltas)
        ]
    token_ids = [] if choice.job.drop_generated else event.token_ids
    if not text and not lps and finish is None and not (parsed.return_token_ids and token_ids):
        return []  # the detokenizer held text back: nothing to say yet
    logprobs = None if choice.completion_logprobs is None else choice.completion_logprobs.take()
    stop_reason = choice.stop_reason if finish else None
    item = R.completion_choice(index, text, logprobs, finish, stop_reason)
    if parsed.return_token_ids:  # vLLM's extension; the router's remote engines read it
        item["token_ids"] = token_ids
    return [item]
