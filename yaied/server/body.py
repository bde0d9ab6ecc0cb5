"""Reading a request's JSON body, bounded by server.max_body_bytes and server.body_timeout_seconds
(shared by every route)."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from starlette.requests import ClientDisconnect, Request

from yaied.server.errors import APIError
from yaied.server.state import ServerState


async def read_json(request: Request) -> dict[str, Any]:
    """The body as a JSON object: 413 past server.max_body_bytes, 400 when malformed."""
    body, _ = await read_sized_json(request)
    return body


async def read_sized_json(request: Request) -> tuple[dict[str, Any], int]:
    """``read_json``, and the body's size in bytes: what parsing it further costs (a route that
    walks thousands of items passes it to ``server.off_loop``). A large body is decoded in the
    CPU thread."""
    server: ServerState = request.state.server
    limit = server.config.max_body_bytes
    too_large = APIError(413, f"request body is larger than {limit} bytes", code="body_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdecimal() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    deadline = server.config.body_timeout_seconds
    try:
        # A deadline for the whole body: a client trickling bytes holds a connection only so long.
        async with asyncio.timeout(deadline):
            async for chunk in request.stream():  # also bounds chunked bodies with no length
                size += len(chunk)
                if size > limit:
                    raise too_large
                chunks.append(chunk)
    except ClientDisconnect:  # the client gave up mid-upload: not a server error (499, as nginx)
        raise APIError(499, "the client disconnected while sending the body") from None
    except TimeoutError:
        message = f"the request body was not sent within {deadline:g} s"
        raise APIError(408, message, code="body_timeout") from None
    return await server.off_loop(size, _decoded, b"".join(chunks)), size


def _decoded(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        # orjson's message locates the fault in the client's own bytes; it holds nothing of ours.
        raise APIError(400, f"malformed JSON body: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the JSON body must be an object", code="invalid_json")
    return body
