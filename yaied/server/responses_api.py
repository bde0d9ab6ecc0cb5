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

With ``conversation`` (conversations_api.py) the stored conversation's items come before the
input, and the turn's input and output are appended to it once it has ended well (``_keep``).

The response object and its events are built in responses_output.py (item ids name their
response, which is how an ``item_reference`` finds its stored item: ``_stored_item``).

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
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from yaied.server.agent_run import ABORTED, AgentRun, ClientGone, collect, start_chat
from yaied.server.auth import api_key_of
from yaied.server.body import read_json
from yaied.server.errors import APIError, json_response
from yaied.server.generate import _SSEResponse
from yaied.server.response_store import ResponseStore, StoredResponse
from yaied.server.responses_output import SSEWriter, Turn, block_events, item_id_prefix
from yaied.server.responses_protocol import check_call_outputs, parse_items, parse_responses
from yaied.server.state import BackgroundRun, ServerState

log = logging.getLogger(__name__)
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
    if request.query_params.get("stream", "false").lower() != "false":
        # OpenAI replays a background response's events; none are kept here
        raise APIError(400, "stored responses are not streamed here: GET without stream",
                       param="stream")  # fmt: skip
    response_id = request.path_params["response_id"]
    namespace = _namespace(request)
    item = _store(request).get(namespace, response_id)
    if item is None:
        # a background response still running whose stored object newer ones pushed out
        running = request.state.server.background.get((namespace, response_id))
        if running is not None:
            return json_response(running.body(running.status))
        raise APIError(404, f"no stored response {response_id!r}", code="response_not_found")
    return json_response(item.body)


async def list_input_items(request: Request) -> Response:
    """OpenAI's list of a response's input items (``page_of``)."""
    response_id = request.path_params["response_id"]
    stored = _store(request).get(_namespace(request), response_id)
    if stored is None:
        raise APIError(404, f"no stored response {response_id!r}", code="response_not_found")
    return json_response(page_of(list(stored.input_items), request, response_id))


def page_of(items: list[dict[str, Any]], request: Request, owner: str) -> dict[str, Any]:
    """One page of ``owner``'s items as OpenAI lists them: ``limit`` (1-100, default 20),
    ``order`` (``desc`` by default), ``after`` / ``before`` an item id of the list; ``include``
    is accepted (nothing here has more to include)."""
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
    items = items if order == "asc" else items[::-1]
    ids = [item["id"] for item in items]
    for name in ("after", "before"):
        if name in query and query[name] not in ids:
            raise APIError(400, f"{name} names no item of {owner!r}", param=name)
    start = ids.index(query["after"]) + 1 if "after" in query else 0
    end = ids.index(query["before"]) if "before" in query else len(ids)
    items = items[start:end]
    page = items[: int(limit)]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > len(page),
    }


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
    if req.parsed.logprobs is not None and server.chat_settings(manager).reasoning:
        # the text's tokens would be mixed with the reasoning's, which the deltas split apart
        text = "logprobs with a reasoning parser are not supported on /v1/responses"
        raise APIError(400, text, param="include")
    turn = Turn(req, response_id, server.model_name)
    if req.previous_response_id is not None:
        previous = server.response_store.get(namespace, req.previous_response_id)
        if previous is None:
            message = f"previous response {req.previous_response_id!r} is not stored here"
            raise APIError(404, message, param="previous_response_id", code="response_not_found")
        if previous.body["status"] in ("queued", "in_progress"):
            message = f"previous response {req.previous_response_id!r} is still in progress"
            raise APIError(400, message, param="previous_response_id")
        turn.history, turn.chain_id = list(previous.messages), previous.chain_id
    if req.conversation_id is not None:  # its items come before this input
        conversation = server.response_store.get_conversation(namespace, req.conversation_id)
        if conversation is None:
            message = f"no conversation {req.conversation_id!r}"
            raise APIError(404, message, param="conversation", code="conversation_not_found")
        turn.history, _ = parse_items(list(conversation.items), where="conversation")
        turn.chain_id = conversation.id  # the session: a conversation stays on its engine
    check_call_outputs(turn.history, req.new_messages)
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    session = request.headers.get("x-session-id") or req.parsed.user or turn.chain_id
    structured = req.parsed.structured  # start_chat settles the output grammar in place
    while True:
        req.parsed.messages = [*system, *turn.history, *req.new_messages]
        try:
            run = await start_chat(
                request, server, manager, req.parsed, request_id,
                session_id=session, max_tokens_name="max_output_tokens", prompt_name="input",
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
    turn.run = run
    headers = {"X-Request-Id": request_id}
    if req.background:
        body = turn.body("queued")
        _keep(server.response_store, namespace, turn, body)
        task = asyncio.create_task(_run_in_background(server, namespace, turn, run))
        running = BackgroundRun(task, run.started.cancel_unfinished, turn.body)
        server.background[(namespace, turn.id)] = running
        # The call runs on past this request: it holds one of its key's max_in_flight until it
        # ends, or a key could start any number of them.
        key = api_key_of(request)
        if key is not None:
            server.keys.hold(key.name)

        def ended(_: asyncio.Task[None]) -> None:
            server.background.pop((namespace, turn.id), None)
            if key is not None:
                server.keys.release(key.name)

        task.add_done_callback(ended)
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
    body = _ended(turn, run)
    _keep(server.response_store, namespace, turn, body)
    return json_response(body, headers=headers)


# A foreground call aborted (POST /v1/requests/{id}/cancel, or the drain's abort on a stop) did
# not complete: it ends failed, so its stream ends with response.failed, the store keeps what it
# wrote as failed and its conversation gets none of it (only completed or incomplete turns).
_ABORTED = {"code": "cancelled", "message": ABORTED}


def _ending(turn: Turn, run: AgentRun) -> str:
    """The status a foreground call's response ends with, once its last event is in."""
    return "failed" if run.choice.finish_reason == "abort" else turn.status(run)


def _ended(turn: Turn, run: AgentRun) -> dict[str, Any]:
    """The finished response object of a foreground call."""
    body = turn.body(_ending(turn, run), run)
    if body["status"] == "failed":
        body["error"] = dict(_ABORTED)
    return body


def _without_oldest_turn(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation without its first message and whatever follows it up to the next user
    message (an answer, its tool calls and their results go with the question they answer)."""
    rest = history[1:]
    while rest and rest[0]["role"] != "user":
        rest = rest[1:]
    return rest


async def _run_in_background(
    server: ServerState, namespace: str, turn: Turn, run: AgentRun
) -> None:
    """A background response's call to its end, then the finished object in the store."""
    status, error, running = "failed", None, False
    try:
        async for deltas in run.deltas():
            if not running:  # its first tokens: no longer queued
                running = True
                _keep(server.response_store, namespace, turn, turn.body("in_progress"))
                background = server.background.get((namespace, turn.id))
                if background is not None:
                    background.status = "in_progress"
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


async def _drain(turn: Turn, run: AgentRun) -> None:
    async for deltas in run.deltas():
        turn.blocks.feed(deltas)
    turn.blocks.close()


def _stored_item(server: ServerState, namespace: str, item_id: str) -> dict[str, Any] | None:
    """The stored item an ``item_reference`` names: its id names its response (see above)."""
    response_suffix = item_id.partition("_")[2].rpartition("_")[0]
    if not response_suffix:
        return None
    stored = server.response_store.get(namespace, "resp_" + response_suffix)
    return None if stored is None else stored.item(item_id)


def with_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Items as a conversation keeps them: each with an id (the client's, or a new one)."""
    return [
        item if "id" in item else {"id": f"{item_id_prefix(item)}_{uuid.uuid4().hex}", **item}
        for item in items
    ]


def append(
    store: ResponseStore, namespace: str, conversation_id: str, items: list[dict[str, Any]]
) -> bool:
    """Add ``items`` to the conversation (conversations_api.py); False if it is gone (deleted,
    or evicted) or would no longer fit the store."""
    old = store.get_conversation(namespace, conversation_id)
    if old is None:
        return False
    return store.put(namespace, old.changed(items=(*old.items, *with_ids(items))))


def _keep(store: ResponseStore, namespace: str, turn: Turn, body: dict[str, Any]) -> None:
    """Store the response (with ``store``) and, once it has ended well, add its input and
    output to its conversation."""
    conversation = turn.req.conversation_id
    ended_well = body["status"] in ("completed", "incomplete")
    if conversation is not None and ended_well:
        added = append(store, namespace, conversation, [*turn.input_items, *body["output"]])
        if not added:
            log.warning("%s: conversation %s is gone or full", turn.id, conversation)
    if turn.req.store:
        item = StoredResponse.make(
            turn.id, turn.conversation(), body, turn.chain_id, turn.input_items
        )
        if not store.put(namespace, item):
            log.warning("%s: too large to store (%d bytes)", turn.id, item.size)


async def _events(
    turn: Turn, run: AgentRun, store: ResponseStore, namespace: str
) -> AsyncIterator[bytes]:
    write = SSEWriter()
    yield write("response.created", response=turn.body("in_progress"))
    yield write("response.in_progress", response=turn.body("in_progress"))
    try:
        async for deltas in run.deltas():
            for event in turn.blocks.feed(deltas):
                for chunk in block_events(turn, write, event):
                    yield chunk
        turn.ending = _ending(turn, run)  # the last item's output_item.done tells it
        for event in turn.blocks.close():
            for chunk in block_events(turn, write, event):
                yield chunk
    except APIError as exc:
        turn.ending = "failed"  # the item it stopped in ends incomplete, as the response says
        for event in turn.blocks.close():
            for chunk in block_events(turn, write, event):
                yield chunk
        error = {"code": str(exc.code or exc.status), "message": exc.message}
        failed = {**turn.body("failed", run), "error": error}
        _keep(store, namespace, turn, failed)  # its id was in response.created: GET finds it
        yield write("response.failed", response=failed)
        return
    body = _ended(turn, run)
    _keep(store, namespace, turn, body)
    yield write(f"response.{body['status']}", response=body)
