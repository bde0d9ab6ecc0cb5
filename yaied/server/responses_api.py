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
Every stored response, foreground too, is found while it runs (responses_running.py: GET as it
stands, DELETE cancels it first, previous_response_id refuses it).

With ``conversation`` (conversations_api.py) the stored conversation's items come before the
input, and the turn's input and output are appended to it once it has ended well
(responses_running.py, ``_keep``).

The response object and its events are built in responses_output.py (item ids name their
response, which is how an ``item_reference`` finds its stored item: ResponseStore.item).

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
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from yaied.server.agent_run import ClientGone, start_chat
from yaied.server.auth import api_key_of
from yaied.server.body import read_sized_json
from yaied.server.errors import APIError, json_response
from yaied.server.generate import _SSEResponse
from yaied.server.response_store import ResponseStore
from yaied.server.responses_output import Turn
from yaied.server.responses_protocol import (
    check_call_outputs,
    parse_items,
    parse_responses,
    referenced_ids,
)
from yaied.server.responses_running import (
    events,
    on_close,
    run_in_background,
    start,
    stop,
    whole,
)
from yaied.server.state import ServerState

log = logging.getLogger(__name__)
_LIST_PARAMS = frozenset({"after", "before", "include", "include[]", "limit", "order"})


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
    key = (_namespace(request), request.path_params["response_id"])
    stored = _store(request).get(*key)  # read: recently used
    running = request.state.server.running_responses.get(key)
    if running is not None and not running.deleted:  # as it stands, even if pushed out
        return json_response(running.body(running.status))
    if stored is None:
        raise APIError(404, f"no stored response {key[1]!r}", code="response_not_found")
    return json_response(stored.body)


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
    returned as it ended; any other is a 400 (OpenAI's rule: a running foreground one runs on;
    DELETE, or POST /v1/requests/{X-Request-Id}/cancel, stops it)."""
    server: ServerState = request.state.server
    key = (_namespace(request), request.path_params["response_id"])
    running = server.running_responses.get(key)
    if running is None or running.background:
        await stop(server, key, delete=False)
        stored = server.response_store.get(*key)
        if stored is None:
            raise APIError(404, f"no stored response {key[1]!r}", code="response_not_found")
        if stored.body.get("background"):
            return json_response(stored.body)
    raise APIError(400, "only background responses can be cancelled", param="response_id")


async def delete_response(request: Request) -> Response:
    key = (_namespace(request), request.path_params["response_id"])
    # a running response is cancelled first (its stream ends failed), or its end would store
    # it again
    ran = await stop(request.state.server, key, delete=True)
    if not _store(request).delete(*key) and not ran:
        raise APIError(404, f"no stored response {key[1]!r}", code="response_not_found")
    return json_response({"id": key[1], "object": "response", "deleted": True})


async def create_response(request: Request) -> Response:
    server: ServerState = request.state.server
    response_id = "resp_" + uuid.uuid4().hex
    request_id = request.headers.get("x-request-id") or response_id
    request.state.request_id = request_id
    manager = server.ready_manager()
    namespace = _namespace(request)
    body, size = await read_sized_json(request)
    # A long history is thousands of items, each some microseconds of Python: a large body is
    # parsed in the CPU thread, the items it references looked up here first (the store is the
    # loop's alone).
    store = server.response_store
    stored = {item_id: store.item(namespace, item_id) for item_id in referenced_ids(body)}
    turn = await server.off_loop(
        size, lambda: Turn(parse_responses(body, stored.get), response_id, server.model_name)
    )
    req = turn.req
    server.check_model(req.parsed.model)
    if req.parsed.logprobs is not None and server.chat_settings(manager).reasoning:
        # the text's tokens would be mixed with the reasoning's, which the deltas split apart
        text = "logprobs with a reasoning parser are not supported on /v1/responses"
        raise APIError(400, text, param="include")
    if req.previous_response_id is not None:
        previous = server.response_store.get(namespace, req.previous_response_id)
        running = server.running_responses.get((namespace, req.previous_response_id))
        if running is not None and not running.deleted:
            message = f"previous response {req.previous_response_id!r} is still in progress"
            raise APIError(400, message, param="previous_response_id")
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
        body = start(server, namespace, turn, run, background=True)
        running = server.running_responses[(namespace, turn.id)]
        task = asyncio.create_task(run_in_background(server, namespace, turn, run))
        running.task = task
        # The call runs on past this request: it holds one of its key's max_in_flight until it
        # ends, or a key could start any number of them.
        key = api_key_of(request)
        if key is not None:
            server.keys.hold(key.name)

        def ended(_: asyncio.Task[None]) -> None:
            if server.running_responses.pop((namespace, turn.id), None) is not None:
                running.ended.set()  # cancelled before it ran: nothing else tells its end
            if key is not None:
                server.keys.release(key.name)

        task.add_done_callback(ended)
        return json_response(body, headers=headers)
    # a stored foreground response is found (GET, DELETE) while it runs, as a background one
    start(server, namespace, turn, run, background=False)
    if req.parsed.stream:
        stream = events(server, namespace, turn, run)
        ping = server.config.sse_ping_seconds
        close = on_close(server, namespace, turn, run)
        return _SSEResponse(stream, close, headers=headers, sep="\n", ping=ping)
    answer = await whole(request, server, namespace, turn, run)
    if answer is None:  # the client left
        return Response(status_code=499)
    return json_response(answer, headers=headers)


def _without_oldest_turn(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation without its first message and whatever follows it up to the next user
    message (an answer, its tool calls and their results go with the question they answer)."""
    rest = history[1:]
    while rest and rest[0]["role"] != "user":
        rest = rest[1:]
    return rest
