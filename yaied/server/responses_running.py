"""A stored ``/v1/responses`` response from its start to its end, in the foreground (streamed or
whole) or the background; responses_api.py answers the routes.

A response with ``store`` (the default) is registered in ``ServerState.running_responses`` while
its call runs, and kept in the store meanwhile at its first status (``queued`` for a background
one, else ``in_progress``): counted in the store's bounds, and pushed out by newer entries like
any other (the registry still answers for it, and its end stores it again):

    start      keep the first object, register the response
    GET        the registered response as it stands (its output so far), else the stored object
    DELETE     ``stop``: cancel its call, wait for its end, which then stores nothing
    cancel     a background response only (OpenAI's rule): it ends ``cancelled``
    finish     keep the final object (unless deleted), unregister, set ``ended``

A foreground response ends with its request: the stream's last event or the whole body, or, when
the client left (or the request failed) before that, ``left``: ``failed`` with the output it had,
never ``in_progress`` for ever. With ``store: false`` nothing is registered or stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import Request

from yaied.server.agent_run import ABORTED, AgentRun, ClientGone, collect
from yaied.server.errors import APIError
from yaied.server.response_store import ResponseStore, StoredResponse
from yaied.server.responses_output import SSEWriter, Turn, block_events, item_id_prefix
from yaied.server.state import RunningResponse, ServerState

log = logging.getLogger(__name__)
CANCEL_WAIT_SECONDS = 10.0  # a cancelled call's abort comes within an engine step

# A foreground call aborted (POST /v1/requests/{id}/cancel, DELETE of its response, the drain's
# abort on a stop) did not complete: it ends failed, so its stream ends with response.failed, the
# store keeps what it wrote as failed and its conversation gets none of it (only completed or
# incomplete turns). So does one whose client left: its call is cancelled with the request.
_ABORTED = {"code": "cancelled", "message": ABORTED}
_LEFT = {
    "code": "cancelled",
    "message": "the client left before the response finished: its call was cancelled",
}


def start(
    server: ServerState, namespace: str, turn: Turn, run: AgentRun, *, background: bool
) -> dict[str, Any]:
    """Keep the response at its first status and register it (with ``store``); that object."""
    body = turn.body("queued" if background else "in_progress")
    _keep(server.response_store, namespace, turn, body, running=True)
    if turn.req.store:
        running = RunningResponse(run.started.cancel_unfinished, turn.body, background)
        running.status = body["status"]
        server.running_responses[(namespace, turn.id)] = running
    return body


def finish(server: ServerState, namespace: str, turn: Turn, body: dict[str, Any]) -> None:
    """The response's final object: kept (stored unless DELETE came first), and its end told."""
    running = server.running_responses.pop((namespace, turn.id), None)
    deleted = running is not None and running.deleted
    _keep(server.response_store, namespace, turn, body, store_it=not deleted)
    if running is not None:
        running.ended.set()


def left(
    server: ServerState, namespace: str, turn: Turn, run: AgentRun, error: dict[str, str]
) -> None:
    """A foreground response whose request ended before its final object (the client left, the
    request failed): it ends failed with ``error`` and the output it had. Once only."""
    if (namespace, turn.id) in server.running_responses:
        finish(server, namespace, turn, {**turn.body("failed", run), "error": error})


async def stop(server: ServerState, key: tuple[str, str], *, delete: bool) -> bool:
    """Cancel the running response ``key`` and wait for its end (within an engine step, unless a
    stalled stream holds it: then at most CANCEL_WAIT_SECONDS); with ``delete`` its end stores
    nothing, else it ends ``cancelled`` (a background one). False when none runs."""
    running = server.running_responses.get(key)
    if running is None:
        return False
    running.deleted = running.deleted or delete
    running.cancelled = not delete
    await running.cancel_calls()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(running.ended.wait(), CANCEL_WAIT_SECONDS)
    return True


def _ending(turn: Turn, run: AgentRun) -> str:
    """The status a foreground call's response ends with, once its last event is in."""
    return "failed" if run.choice.finish_reason == "abort" else turn.status(run)


def _ended(turn: Turn, run: AgentRun) -> dict[str, Any]:
    """The finished response object of a foreground call."""
    body = turn.body(_ending(turn, run), run)
    if body["status"] == "failed":
        body["error"] = dict(_ABORTED)
    return body


async def whole(
    request: Request, server: ServerState, namespace: str, turn: Turn, run: AgentRun
) -> dict[str, Any] | None:
    """A foreground response read to its end and kept; None when the client left first."""
    try:
        await collect(request, run.started, lambda: _drain(turn, run))
    except ClientGone:
        left(server, namespace, turn, run, _LEFT)
        return None
    except BaseException as exc:  # the engine failed the call (a 500), or the server stops
        error = {"code": "server_error", "message": "the server stopped before it finished"}
        if isinstance(exc, APIError):
            error = {"code": exc.code or "server_error", "message": exc.message}
        left(server, namespace, turn, run, error)
        raise
    body = _ended(turn, run)
    finish(server, namespace, turn, body)
    return body


async def _drain(turn: Turn, run: AgentRun) -> None:
    async for deltas in run.deltas():
        turn.blocks.feed(deltas)
    turn.blocks.close()


def on_close(
    server: ServerState, namespace: str, turn: Turn, run: AgentRun
) -> Callable[[], Awaitable[None]]:
    """What a streamed response runs however its stream ends: its call cancelled if unfinished,
    and, if the stream stopped before its last event (the client left), its end kept."""

    async def close() -> None:
        try:
            await run.started.cancel_unfinished()
        finally:
            # the stream's last event stores the end; before it, the client left (or the
            # stream failed, which the log tells)
            left(server, namespace, turn, run, _LEFT)

    return close


async def events(
    server: ServerState, namespace: str, turn: Turn, run: AgentRun
) -> AsyncIterator[bytes]:
    """A foreground response's typed SSE events; its final object is kept before the last."""
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
        finish(server, namespace, turn, failed)  # its id was in response.created: GET finds it
        yield write("response.failed", response=failed)
        return
    body = _ended(turn, run)
    finish(server, namespace, turn, body)
    yield write(f"response.{body['status']}", response=body)


async def run_in_background(server: ServerState, namespace: str, turn: Turn, run: AgentRun) -> None:
    """A background response's call to its end, then the finished object in the store."""
    status, error, key = "failed", None, (namespace, turn.id)
    try:
        async for deltas in run.deltas():
            running = server.running_responses.get(key)
            if running is not None and running.status == "queued":  # its first tokens
                running.status = "in_progress"
                if not running.deleted:
                    body = turn.body("in_progress")
                    _keep(server.response_store, namespace, turn, body, running=True)
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
        running = server.running_responses.get(key)
        if running is not None and running.cancelled:
            status, error = "cancelled", None
        body = turn.body(status, run)
        body["error"] = error
        finish(server, namespace, turn, body)


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


def _keep(
    store: ResponseStore,
    namespace: str,
    turn: Turn,
    body: dict[str, Any],
    *,
    store_it: bool = True,
    running: bool = False,
) -> None:
    """Store the response (with ``store``, unless ``store_it`` is False: it was deleted) and,
    once it has ended well, add its input and output to its conversation. A ``running`` one is
    kept without its conversation's history: nothing continues it before its end, which stores
    it whole, and serialising a long history on the event loop twice a turn is not free."""
    conversation = turn.req.conversation_id
    ended_well = body["status"] in ("completed", "incomplete")
    if conversation is not None and ended_well:
        added = append(store, namespace, conversation, [*turn.input_items, *body["output"]])
        if not added:
            log.warning("%s: conversation %s is gone or full", turn.id, conversation)
    if turn.req.store and store_it:
        history = [] if running else turn.conversation()
        item = StoredResponse.make(turn.id, history, body, turn.chain_id, turn.input_items)
        if not store.put(namespace, item):
            log.warning("%s: too large to store (%d bytes)", turn.id, item.size)
