"""The two generation endpoints: /v1/completions and /v1/chat/completions.

Both parse, build jobs (every 4xx is decided here, before the engine sees anything), then either
stream SSE chunks or collect the events into one body. A non-streaming client that leaves is
noticed by a watcher on the ASGI receive channel, which cancels the collection and so aborts its
requests within one engine step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
from sse_starlette import EventSourceResponse
from starlette.requests import Request
from starlette.responses import Response

from yaied.request import FinishReason
from yaied.server import responses as R
from yaied.server.errors import APIError, error_body, json_response
from yaied.server.limits import RequestLimits
from yaied.server.protocol import ParsedRequest, parse_chat, parse_completion
from yaied.server.serving import ChoiceState, Job, build_jobs, new_choices, run_jobs, total_usage
from yaied.server.state import ServerState

log = logging.getLogger(__name__)
DONE = b"data: [DONE]\n\n"


async def completions(request: Request) -> Response:
    return await _generate(request, "completion")


async def chat_completions(request: Request) -> Response:
    return await _generate(request, "chat")


async def _generate(request: Request, kind: str) -> Response:
    from yaied.server.app import read_json  # the body reader shared with the other routes

    server: ServerState = request.state.server
    prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
    request_id = request.headers.get("x-request-id") or prefix + uuid.uuid4().hex
    request.state.request_id = request_id
    engine = server.ready_engine()
    body = await read_json(request)
    parsed = parse_chat(body) if kind == "chat" else parse_completion(body)
    server.check_model(parsed.model)
    limits = RequestLimits.from_config(server.config)
    limits.check_parsed(parsed, body)
    jobs = build_jobs(engine, parsed, request_id, server.config.chat_template, limits)
    server.check_queue(engine)
    head = R.ResponseHead(request_id, int(time.time()), server.model_name)
    session_id = request.headers.get("x-session-id") or parsed.user
    events = run_jobs(engine, jobs, server.metrics, session_id=session_id, priority=parsed.priority)
    choices = new_choices(jobs, parsed, R.token_text_fn(engine.tokenizer))
    headers = {"X-Request-Id": request_id}
    if parsed.stream:
        stream = _sse(parsed, head, choices, events)
        return EventSourceResponse(
            stream, headers=headers, sep="\n", ping=server.config.sse_ping_seconds
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
    if collect.cancelled():
        log.info("%s: client disconnected; aborted", request_id)
        return Response(status_code=499)  # nobody reads it; the access log shows why
    return json_response(collect.result(), headers=headers)


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
                raise APIError(500, f"generation failed: {event.error}", code="engine_error")
            choices[job.index].update(event)
    out = []
    for c in choices:
        text, index = "".join(c.text), c.job.index
        if parsed.kind == "chat":
            lps = None
            if parsed.logprobs is not None:
                lps = R.chat_logprobs(c.token_text, c.chat_logprobs)
            out.append(R.chat_message_choice(index, text, lps, c.finish_reason, c.stop_reason))
        else:
            lps = None if c.completion_logprobs is None else c.completion_logprobs.take()
            out.append(R.completion_choice(index, text, lps, c.finish_reason, c.stop_reason))
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
                    message = f"generation failed: {event.error}"
                    yield _data(error_body(500, message, code="engine_error"))
                    break
                item = _choice_chunk(parsed, choices[job.index], event)
                if item is not None:
                    yield chunk([item])
            else:
                if parsed.include_usage:
                    yield chunk([], R.usage_body(*total_usage(choices)))
        except APIError as exc:
            yield _data(exc.body())
        except Exception as exc:
            log.exception("%s: stream failed", head.id)
            yield _data(error_body(500, f"stream failed: {exc}"))
    yield DONE


def _choice_chunk(parsed: ParsedRequest, choice: ChoiceState, event: Any) -> dict[str, Any] | None:
    text, lps = choice.update(event)
    finish = choice.finish_reason if event.finished else None
    token_ids = [] if choice.job.drop_generated else event.token_ids
    if not text and not lps and finish is None and not (parsed.return_token_ids and token_ids):
        return None  # the detokenizer held text back: nothing to say yet
    index = choice.job.index
    if parsed.kind == "chat":
        logprobs = R.chat_logprobs(choice.token_text, lps) if parsed.logprobs is not None else None
        delta = {"content": text} if text else {}
        return R.chat_delta_choice(index, delta, logprobs, finish)
    logprobs = None if choice.completion_logprobs is None else choice.completion_logprobs.take()
    stop_reason = choice.stop_reason if finish else None
    item = R.completion_choice(index, text, logprobs, finish, stop_reason)
    if parsed.return_token_ids:  # vLLM's extension; the router's remote engines read it
        item["token_ids"] = token_ids
    return item
