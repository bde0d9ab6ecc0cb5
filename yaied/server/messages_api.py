"""``/v1/messages``: Anthropic's Messages API over the chat path.

    POST /v1/messages               parse (messages_protocol.py), run as one chat choice
                                    (agent_run.py), answer one message or Anthropic's SSE events
    POST /v1/messages/count_tokens  the rendered prompt's length, nothing run

Content blocks come from agent_output.Blocks: thinking (with a reasoning parser), text and
tool_use, in the order the model wrote them. Errors before the response are rewritten into
Anthropic's shape by error_shape.py; after the first byte they travel as an ``error`` event.
Anthropic has no stop reason for a call aborted before it finished (a cancel, the drain): it
ends as an error too (agent_run.abort_error), never as ``end_turn``.
Anthropic's ``input_tokens`` excludes the prompt tokens read from the cache, which it reports as
``cache_read_input_tokens``; the two add up to the prompt.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from yaied.router.manager import EngineManager
from yaied.server.admission import request_size
from yaied.server.agent_output import Block, BlockEvent, Blocks, finish_kind
from yaied.server.agent_run import AgentRun, ClientGone, abort_error, collect, start_chat
from yaied.server.body import read_sized_json
from yaied.server.context_edits import apply_edits
from yaied.server.error_shape import anthropic_error
from yaied.server.errors import APIError, from_value_error, json_response
from yaied.server.generate import _SSEResponse
from yaied.server.messages_protocol import MessagesRequest, parse_anthropic
from yaied.server.protocol import ParsedRequest
from yaied.server.state import ServerState

log = logging.getLogger(__name__)
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def routes() -> list[Route]:
    return [
        Route("/v1/messages", create_message, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
    ]


async def count_tokens(request: Request) -> Response:
    server: ServerState = request.state.server
    manager = server.ready_manager()
    req = await _parsed(request, server, count_only=True)
    server.check_model(req.parsed.model)
    count = functools.partial(_prompt_tokens, server, manager, req.parsed)
    tokens = await count(req.parsed.messages)
    if not req.context_edits:
        return json_response({"input_tokens": tokens})
    # with edits, Anthropic counts the prompt the model would read, and the original beside it
    edited, _ = await apply_edits(req.context_edits, req.parsed.messages, count)
    body = {
        "input_tokens": await count(edited),
        "context_management": {"original_input_tokens": tokens},
    }
    return json_response(body)


async def _parsed(
    request: Request, server: ServerState, count_only: bool = False
) -> MessagesRequest:
    """The request, parsed in the CPU thread when its body is large: a long conversation is
    thousands of messages, each some microseconds of Python that would stall every stream."""
    body, size = await read_sized_json(request)
    parse = functools.partial(parse_anthropic, count_only=count_only)
    return await server.off_loop(size, parse, body)


async def _prompt_tokens(
    server: ServerState, manager: EngineManager, parsed: ParsedRequest, messages: list[Any]
) -> int:
    """The length of the prompt ``messages`` render to with ``parsed``'s tools and options."""
    render = functools.partial(
        manager.inputs.chat_prompt,
        messages,
        server.config.chat_template,
        add_generation_prompt=parsed.add_generation_prompt,
        continue_final_message=parsed.continue_final_message,
        template_kwargs=parsed.chat_template_kwargs,
        tools=parsed.tools.definitions() or None,
        tool_format=server.chat_settings(manager).tool_format,
    )
    try:  # a large conversation renders in the CPU thread, as the generation endpoints do
        ids, _ = await server.off_loop(request_size(parsed), render)
    except ValueError as exc:
        raise from_value_error(exc) from None
    return len(ids)


async def _too_long(
    exc: APIError, server: ServerState, manager: EngineManager, parsed: ParsedRequest
) -> None:
    """A prompt past the context in Anthropic's words, ``prompt is too long: N tokens > M
    maximum``, which Claude Code reads (the words and both numbers) to compact its conversation
    by the tokens it is over instead of ending the session. max_tokens is cut to the context's
    room here, so only the prompt can be too long."""
    tokens = await _prompt_tokens(server, manager, parsed, parsed.messages)
    exc.message = f"prompt is too long: {tokens} tokens > {manager.info.max_model_len} maximum"


def _block_body(block: Block, done: bool = True, omit_thinking: bool = False) -> dict[str, Any]:
    if block.kind == "reasoning":
        text = block.text if done and not omit_thinking else ""
        return {"type": "thinking", "thinking": text, "signature": ""}
    if block.kind == "text":
        return {"type": "text", "text": block.text if done else ""}
    arguments: Any = {}
    if done:
        try:
            arguments = orjson.loads(block.text or "{}")
        except orjson.JSONDecodeError:  # cut off by max_tokens: the JSON is unfinished
            arguments = {}
    return {"type": "tool_use", "id": block.call_id, "name": block.name, "input": arguments}


def _stop(req: MessagesRequest, run: AgentRun, blocks: list[Block]) -> tuple[str, str | None]:
    stop_reason = run.choice.stop_reason
    if isinstance(stop_reason, str) and stop_reason in req.stop_sequences:
        return "stop_sequence", stop_reason
    kind = finish_kind(run.choice.finish_reason, blocks)
    if kind == "length" and run.usage[1] < (req.parsed.max_tokens or 0):
        # cut by the context's end before the client's max_tokens (serving.py cuts it to the room)
        return "model_context_window_exceeded", None
    return _STOP_REASONS.get(kind, "end_turn"), None


def _message_start(run: AgentRun, message: dict[str, Any]) -> bytes:
    usage = {**_usage(run), "output_tokens": 0}
    return _event("message_start", message={**message, "usage": usage})


def _usage(run: AgentRun) -> dict[str, int]:
    prompt, output, cached = run.usage
    return {"input_tokens": prompt - cached, "output_tokens": output,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}  # fmt: skip


def _message(message_id: str, model: str) -> dict[str, Any]:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": [], "stop_reason": None, "stop_sequence": None}  # fmt: skip


async def create_message(request: Request) -> Response:
    server: ServerState = request.state.server
    message_id = "msg_" + uuid.uuid4().hex
    request_id = request.headers.get("x-request-id") or message_id
    request.state.request_id = request_id
    manager = server.ready_manager()
    req = await _parsed(request, server)
    server.check_model(req.parsed.model)
    applied = None
    if req.context_edits:  # trimmed before the model reads it (context_edits.py)
        count = functools.partial(_prompt_tokens, server, manager, req.parsed)
        req.parsed.messages, applied = await apply_edits(
            req.context_edits, req.parsed.messages, count
        )
    session = request.headers.get("x-session-id") or req.parsed.user
    try:
        run = await start_chat(
            request, server, manager, req.parsed, request_id,
            session_id=session, max_tokens_name="max_tokens",
        )  # fmt: skip
    except ClientGone:
        return Response(status_code=499)
    except APIError as exc:
        if exc.code == "context_length_exceeded":
            await _too_long(exc, server, manager, req.parsed)
        raise
    headers = {"X-Request-Id": request_id, "request-id": request_id}
    message = _message(message_id, server.model_name)
    if applied is not None:
        message["context_management"] = {"applied_edits": applied}
    if req.parsed.stream:
        stream = _events(req, run, message, server)
        ping = server.config.sse_ping_seconds
        return _SSEResponse(
            stream, run.started.cancel_unfinished, headers=headers, sep="\n", ping=ping
        )
    blocks = Blocks()

    async def drain() -> None:
        async for deltas in run.deltas():
            blocks.feed(deltas)
        blocks.close()

    try:
        await collect(request, run.started, drain)
    except ClientGone:
        return Response(status_code=499)
    if run.choice.finish_reason == "abort":  # Anthropic has no stop reason for a cut call
        raise abort_error(server)
    stop_reason, stop_sequence = _stop(req, run, blocks.blocks)
    message["content"] = [_block_body(b, omit_thinking=req.omit_thinking) for b in blocks.blocks]
    message.update(stop_reason=stop_reason, stop_sequence=stop_sequence, usage=_usage(run))
    return json_response(message, headers=headers)


def _event(kind: str, **fields: Any) -> bytes:
    payload = orjson.dumps({"type": kind, **fields})
    return b"event: " + kind.encode() + b"\ndata: " + payload + b"\n\n"


async def _events(
    req: MessagesRequest, run: AgentRun, message: dict[str, Any], server: ServerState
) -> AsyncIterator[bytes]:
    # message_start waits for the engine's first event (or the end, or an error), which tells
    # how much of the prompt the cache held: its usage splits the input as message_delta's
    # does (clients read a stream's input tokens from message_start). An aborted call ends
    # with an error event, as a failed one does: never a stop_reason that says it finished.
    blocks, started = Blocks(), False
    try:
        async with contextlib.aclosing(run.deltas()) as stream:
            async for deltas in stream:
                if not started:
                    started = True
                    yield _message_start(run, message)
                for event in blocks.feed(deltas):
                    if _shown(event, req):
                        yield _block_event(event)
        if run.choice.finish_reason == "abort":
            raise abort_error(server)
        if not started:
            started = True
            yield _message_start(run, message)
        for event in blocks.close():
            if _shown(event, req):
                yield _block_event(event)
    except APIError as exc:
        if not started:
            yield _message_start(run, message)
        yield _event("error", error=anthropic_error(exc.status, exc.message)["error"])
        return
    stop_reason, stop_sequence = _stop(req, run, blocks.blocks)
    delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
    extra = {k: message[k] for k in ("context_management",) if k in message}
    yield _event("message_delta", delta=delta, usage=_usage(run), **extra)
    yield _event("message_stop")


def _shown(event: BlockEvent, req: MessagesRequest) -> bool:
    """Whether the stream sends ``event``: with thinking omitted, a thinking block starts and
    stops but none of its text is sent."""
    return not (req.omit_thinking and event.block.kind == "reasoning" and event.action == "delta")


def _block_event(event: BlockEvent) -> bytes:
    block = event.block
    if event.action == "start":
        body = _block_body(block, done=False)
        return _event("content_block_start", index=block.index, content_block=body)
    if event.action == "stop":
        return _event("content_block_stop", index=block.index)
    if block.kind == "tool_call":
        delta = {"type": "input_json_delta", "partial_json": event.delta}
    elif block.kind == "text":
        delta = {"type": "text_delta", "text": event.delta}
    else:
        delta = {"type": "thinking_delta", "thinking": event.delta}
    return _event("content_block_delta", index=block.index, delta=delta)
