"""``/v1/responses``: OpenAI's Responses API over the chat path, stateful through a bounded store.

    POST   /v1/responses        parse (responses_protocol.py), prepend the stored conversation of
                                previous_response_id, run as one chat choice (agent_run.py), and
                                answer one response object or its typed SSE events
    GET    /v1/responses/{id}   the stored object (404 unless stored under the caller's key)
    DELETE /v1/responses/{id}
    GET    /v1/responses/{id}/input_items   that response's input items, a page at a time
    POST   /v1/responses/{id}/cancel        a background response still running

With ``background`` the response object (status ``queued``) is stored and answered at once, the
call runs on in a task of its own (the client may leave), and the stored object becomes the
finished one (``completed``, ``incomplete``, ``failed``, or ``cancelled`` by the cancel route).

Items get ids that name their response (``msg_<response>_<n>`` for output n,
``msg_<response>_in<n>`` for input n; ``fc``, ``fco``, ``rs`` for calls, call outputs and
reasoning), so an ``item_reference`` in a later input finds its stored response without an
index of its own.

A continued chain's prompt is the previous turn's prompt, its output and the new input, so its
prefix is in the radix cache; every call of one chain carries the chain's first id as its
session (unless the client sends X-Session-Id or `user`), so the router keeps a long chain on the
engine that holds that prefix (router/policy.py: calls past long_call_threshold follow their
session's pin). Output items: reasoning (with a reasoning parser), message, function_call, in the
order the model wrote them (agent_output.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from yaied.server.agent_output import Block, BlockEvent, Blocks, finish_kind
from yaied.server.agent_run import AgentRun, ClientGone, collect, start_chat
from yaied.server.auth import api_key_of
from yaied.server.body import read_json
from yaied.server.errors import APIError, json_response
from yaied.server.generate import _SSEResponse
from yaied.server.response_store import ResponseStore, StoredResponse
from yaied.server.responses_protocol import ResponsesRequest, parse_responses
from yaied.server.state import BackgroundRun, ServerState

log = logging.getLogger(__name__)
_ITEM_PREFIX = {"reasoning": "rs", "text": "msg", "tool_call": "fc"}
_INPUT_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
                 "reasoning": "rs"}  # fmt: skip
_LIST_PARAMS = frozenset({"after", "before", "include", "include[]", "limit", "order"})
CANCEL_WAIT_SECONDS = 10.0  # a cancelled call's abort comes within an engine step


def routes() -> list[Route]:
    return [
        Route("/v1/responses", create_response, methods=["POST"]),
        Route("/v1/responses/{response_id}", get_response, methods=["GET"]),
        Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
        Route("/v1/responses/{response_id}/input_items", list_input_items, methods=["GET"]),
        Route("/v1/responses/{response_id}/cancel", cancel_response, methods=["POST"]),
    ]


def _namespace(request: Request) -> str:
    key = api_key_of(request)
    return "" if key is None else key.name


def _store(request: Request) -> ResponseStore:
    server: ServerState = request.state.server
    return server.response_store


async def get_response(request: Request) -> Response:
    response_id = request.path_params["response_id"]
    item = _store(request).get(_namespace(request), response_id)
    if item is None:
        raise APIError(404, f"no stored response {response_id!r}", code="response_not_found")
    return json_response(item.body)


async def list_input_items(request: Request) -> Response:
    """OpenAI's list of a response's input items: ``limit`` (1-100, default 20), ``order``
    (``desc`` by default), ``after`` / ``before`` an item id of the list; ``include`` is
    accepted (nothing here has more to include)."""
    response_id = request.path_params["response_id"]
    stored = _store(request).get(_namespace(request), response_id)
    if stored is None:
        raise APIError(404, f"no stored response {response_id!r}", code="response_not_found")
    query = request.query_params
    for name in query:
        if name not in _LIST_PARAMS:
            raise APIError(400, f"unknown query parameter {name!r}", param=name)
    limit = query.get("limit", "20")
    if not (limit.isascii() and limit.isdigit() and 1 <= int(limit[:4]) <= 100):
        raise APIError(400, "limit must be an integer from 1 to 100", param="limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise APIError(400, 'order must be "asc" or "desc"', param="order")
    items = list(stored.input_items if order == "asc" else reversed(stored.input_items))
    ids = [item["id"] for item in items]
    for name in ("after", "before"):
        if name in query and query[name] not in ids:
            raise APIError(400, f"{name} names no input item of {response_id!r}", param=name)
    start = ids.index(query["after"]) + 1 if "after" in query else 0
    end = ids.index(query["before"]) if "before" in query else len(ids)
    items = items[start:end]
    page = items[: int(limit)]
    return json_response(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > len(page),
        }
    )


async def cancel_response(request: Request) -> Response:
    """Cancel a background response still running: its call is cancelled (within an engine
    step) and it ends ``cancelled``, what this returns. A finished background response is
    returned as it ended; any other is a 400."""
    server: ServerState = request.state.server
    key = (_namespace(request), request.path_params["response_id"])
    await _stop_background(server, key)
    stored = server.response_store.get(*key)
    if stored is None:
        raise APIError(404, f"no stored response {key[1]!r}", code="response_not_found")
    if not stored.body.get("background"):
        raise APIError(400, "only background responses can be cancelled", param="response_id")
    return json_response(stored.body)


async def _stop_background(server: ServerState, key: tuple[str, str]) -> None:
    """Cancel the background response ``key`` if it still runs, and wait for its end."""
    running = server.background.get(key)
    if running is not None:
        running.cancelled = True
        await running.cancel_calls()
        await asyncio.wait({running.task}, timeout=CANCEL_WAIT_SECONDS)


async def delete_response(request: Request) -> Response:
    response_id = request.path_params["response_id"]
    # a running background response is cancelled first, or its end would store it again
    await _stop_background(request.state.server, (_namespace(request), response_id))
    if not _store(request).delete(_namespace(request), response_id):
        raise APIError(404, f"no stored response {response_id!r}", code="response_not_found")
    return json_response({"id": response_id, "object": "response", "deleted": True})


class _Turn:
    """One response being made: its request, ids and the blocks its output has so far."""

    def __init__(self, req: ResponsesRequest, response_id: str, model: str) -> None:
        self.req = req
        self.id = response_id
        self.model = model
        self.created = int(time.time())
        self.blocks = Blocks()
        self.history: list[dict[str, Any]] = []  # the stored conversation before this turn
        self.chain_id = response_id
        # this turn's input items, each with an id (the client's, or one naming this response)
        self.input_items = [
            item
            if "id" in item
            else {"id": f"{_INPUT_PREFIX[item['type']]}_{response_id[5:]}_in{i}", **item}
            for i, item in enumerate(req.input_items)
        ]

    def item_id(self, block: Block) -> str:
        return f"{_ITEM_PREFIX[block.kind]}_{self.id[5:]}_{block.index}"

    def item(self, block: Block, done: bool = True) -> dict[str, Any]:
        status = "completed" if done else "in_progress"
        text = block.text if done else ""
        if block.kind == "reasoning":
            content = [{"type": "reasoning_text", "text": text}] if done else []
            return {"type": "reasoning", "id": self.item_id(block), "summary": [],
                    "content": content, "status": status}  # fmt: skip
        if block.kind == "tool_call":
            return {"type": "function_call", "id": self.item_id(block), "call_id": block.call_id,
                    "name": block.name, "arguments": text, "status": status}  # fmt: skip
        content = [_text_part(text)] if done else []
        return {"type": "message", "id": self.item_id(block), "status": status,
                "role": "assistant", "content": content}  # fmt: skip

    def body(self, status: str, run: AgentRun | None = None) -> dict[str, Any]:
        req, done = self.req, status not in ("queued", "in_progress")
        output = [self.item(block) for block in self.blocks.blocks] if done else []
        body: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": self.model, "output": output, "error": None, "incomplete_details": None,
            "instructions": req.instructions, "metadata": req.metadata,
            "max_output_tokens": req.parsed.max_tokens,
            "temperature": req.parsed.sampling.get("temperature"),
            "top_p": req.parsed.sampling.get("top_p"),
            "parallel_tool_calls": req.parsed.tools.parallel, "tool_choice": req.tool_choice,
            "tools": req.tools, "text": {"format": req.text_format}, "truncation": req.truncation,
            "previous_response_id": req.previous_response_id, "store": req.store,
            "reasoning": {"effort": req.effort, "summary": None}, "user": req.parsed.user,
            "usage": None, "background": req.background,
        }  # fmt: skip
        if status == "incomplete":
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        if done:
            body["output_text"] = "".join(b.text for b in self.blocks.blocks if b.kind == "text")
        if run is not None:
            prompt, output_tokens, cached = run.usage
            body["usage"] = {
                "input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + output_tokens,
            }  # fmt: skip
        return body

    def status(self, run: AgentRun) -> str:
        kind = finish_kind(run.choice.finish_reason, self.blocks.blocks)
        return "incomplete" if kind == "length" else "completed"

    def conversation(self) -> list[dict[str, Any]]:
        """What the next turn continues: the history, this input, this output (no reasoning,
        no instructions)."""
        blocks = self.blocks.blocks
        calls = [
            {"id": b.call_id, "type": "function", "function": {"name": b.name, "arguments": b.text}}
            for b in blocks
            if b.kind == "tool_call"
        ]
        reply: dict[str, Any] = {"role": "assistant"}
        reply["content"] = "".join(b.text for b in blocks if b.kind == "text")
        if calls:
            reply["tool_calls"] = calls
        return [*self.history, *self.req.new_messages, reply]


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


async def create_response(request: Request) -> Response:
    server: ServerState = request.state.server
    response_id = "resp_" + uuid.uuid4().hex
    request_id = request.headers.get("x-request-id") or response_id
    request.state.request_id = request_id
    manager = server.ready_manager()
    namespace = _namespace(request)
    req = parse_responses(
        await read_json(request), lambda item_id: _stored_item(server, namespace, item_id)
    )
    server.check_model(req.parsed.model)
    turn = _Turn(req, response_id, server.model_name)
    if req.previous_response_id is not None:
        previous = server.response_store.get(namespace, req.previous_response_id)
        if previous is None:
            message = f"previous response {req.previous_response_id!r} is not stored here"
            raise APIError(404, message, param="previous_response_id", code="response_not_found")
        if previous.body["status"] in ("queued", "in_progress"):
            message = f"previous response {req.previous_response_id!r} is still in progress"
            raise APIError(400, message, param="previous_response_id")
        turn.history, turn.chain_id = list(previous.messages), previous.chain_id
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    session = request.headers.get("x-session-id") or req.parsed.user or turn.chain_id
    structured = req.parsed.structured  # start_chat settles the output grammar in place
    while True:
        req.parsed.messages = [*system, *turn.history, *req.new_messages]
        try:
            run = await start_chat(
                request, server, manager, req.parsed, request_id,
                session_id=session, max_tokens_name="max_output_tokens",
            )  # fmt: skip
            break
        except ClientGone:
            return Response(status_code=499)
        except APIError as exc:
            # truncation "auto": the stored conversation loses its oldest turn until it fits
            overflow = exc.code == "context_length_exceeded"
            if req.truncation != "auto" or not overflow or not turn.history:
                raise
            turn.history = _without_oldest_turn(turn.history)
            req.parsed.structured = structured
    headers = {"X-Request-Id": request_id}
    if req.background:
        body = turn.body("queued")
        _keep(server.response_store, namespace, turn, body)
        task = asyncio.create_task(_run_in_background(server, namespace, turn, run))
        server.background[(namespace, turn.id)] = BackgroundRun(task, run.started.cancel_unfinished)
        task.add_done_callback(lambda _: server.background.pop((namespace, turn.id), None))
        return json_response(body, headers=headers)
    if req.parsed.stream:
        stream = _events(turn, run, server.response_store, namespace)
        ping = server.config.sse_ping_seconds
        return _SSEResponse(
            stream, run.started.cancel_unfinished, headers=headers, sep="\n", ping=ping
        )
    try:
        await collect(request, run.started, lambda: _drain(turn, run))
    except ClientGone:
        return Response(status_code=499)
    body = turn.body(turn.status(run), run)
    _keep(server.response_store, namespace, turn, body)
    return json_response(body, headers=headers)


def _without_oldest_turn(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation without its first message and whatever follows it up to the next user
    message (an answer, its tool calls and their results go with the question they answer)."""
    rest = history[1:]
    while rest and rest[0]["role"] != "user":
        rest = rest[1:]
    return rest


async def _run_in_background(
    server: ServerState, namespace: str, turn: _Turn, run: AgentRun
) -> None:
    """A background response's call to its end, then the finished object in the store."""
    status, error, running = "failed", None, False
    try:
        async for deltas in run.deltas():
            if not running:  # its first tokens: no longer queued
                running = True
                _keep(server.response_store, namespace, turn, turn.body("in_progress"))
            turn.blocks.feed(deltas)
        turn.blocks.close()
        if run.choice.finish_reason == "abort":  # not by the cancel route: the engines stopped
            status = "failed"
            error = {"code": "server_error", "message": "the call was aborted by the server"}
        else:
            status = turn.status(run)
    except APIError as exc:  # the engine failed the call
        error = {"code": exc.code or "server_error", "message": exc.message}
    except asyncio.CancelledError:  # the daemon stops
        error = {"code": "server_error", "message": "the server stopped before it finished"}
        raise
    finally:
        await asyncio.shield(run.started.cancel_unfinished())
        background = server.background.get((namespace, turn.id))
        if background is not None and background.cancelled:
            status, error = "cancelled", None
        body = turn.body(status, run)
        body["error"] = error
        _keep(server.response_store, namespace, turn, body)


async def _drain(turn: _Turn, run: AgentRun) -> None:
    async for deltas in run.deltas():
        turn.blocks.feed(deltas)
    turn.blocks.close()


def _stored_item(server: ServerState, namespace: str, item_id: str) -> dict[str, Any] | None:
    """The stored item an ``item_reference`` names: its id names its response (see above)."""
    _, _, rest = item_id.partition("_")
    response_suffix = rest.rpartition("_")[0]
    stored = server.response_store.get(namespace, "resp_" + response_suffix)
    return None if stored is None or not response_suffix else stored.item(item_id)


def _keep(store: ResponseStore, namespace: str, turn: _Turn, body: dict[str, Any]) -> None:
    if turn.req.store:
        item = StoredResponse.make(
            turn.id, turn.conversation(), body, turn.chain_id, turn.input_items
        )
        if not store.put(namespace, item):
            log.warning("%s: too large to store (%d bytes)", turn.id, item.size)


class _Writer:
    """SSE events as OpenAI sends them: ``event: <type>`` and the JSON with sequence_number."""

    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


async def _events(
    turn: _Turn, run: AgentRun, store: ResponseStore, namespace: str
) -> AsyncIterator[bytes]:
    write = _Writer()
    yield write("response.created", response=turn.body("in_progress"))
    yield write("response.in_progress", response=turn.body("in_progress"))
    try:
        async for deltas in run.deltas():
            for event in turn.blocks.feed(deltas):
                for chunk in _block_events(turn, write, event):
                    yield chunk
        for event in turn.blocks.close():
            for chunk in _block_events(turn, write, event):
                yield chunk
    except APIError as exc:
        error = {"code": str(exc.code or exc.status), "message": exc.message}
        failed = {**turn.body("failed", run), "error": error}
        yield write("response.failed", response=failed)
        return
    status = turn.status(run)
    body = turn.body(status, run)
    _keep(store, namespace, turn, body)
    yield write(f"response.{status}", response=body)


def _block_events(turn: _Turn, write: _Writer, event: BlockEvent) -> list[bytes]:
    block, at = event.block, {"output_index": event.block.index}
    item_id = turn.item_id(block)
    if event.action == "start":
        out = [write("response.output_item.added", item=turn.item(block, done=False), **at)]
        if block.kind == "text":
            part = _text_part("")
            out.append(write("response.content_part.added", item_id=item_id, content_index=0,
                             part=part, **at))  # fmt: skip
        return out
    if event.action == "delta":
        if block.kind == "tool_call":
            kind, extra = "response.function_call_arguments.delta", {}
        elif block.kind == "text":
            kind, extra = "response.output_text.delta", {"content_index": 0, "logprobs": []}
        else:
            kind, extra = "response.reasoning_text.delta", {"content_index": 0}
        return [write(kind, item_id=item_id, delta=event.delta, **extra, **at)]
    text, out = block.text, []
    if block.kind == "tool_call":
        out.append(write("response.function_call_arguments.done", item_id=item_id,
                         name=block.name, arguments=text, **at))  # fmt: skip
    elif block.kind == "text":
        out.append(write("response.output_text.done", item_id=item_id, content_index=0,
                         text=text, logprobs=[], **at))  # fmt: skip
        out.append(write("response.content_part.done", item_id=item_id, content_index=0,
                         part=_text_part(text), **at))  # fmt: skip
    else:
        out.append(write("response.reasoning_text.done", item_id=item_id, content_index=0,
                         text=text, **at))  # fmt: skip
    out.append(write("response.output_item.done", item=turn.item(block), **at))
    return out
