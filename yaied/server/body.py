"""Reading a request's JSON body, bounded by server.max_body_bytes (shared by every route)."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import ClientDisconnect, Request

from yaied.server.errors import APIError
from yaied.server.state import ServerState


async def read_json(request: Request) -> dict[str, Any]:
    """The body as a JSON object: 413 past server.max_body_bytes, 400 when malformed."""
    server: ServerState = request.state.server
    limit = server.config.max_body_bytes
    too_large = APIError(413, f"request body is larger than {limit} bytes", code="body_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdecimal() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    try:
        async for chunk in request.stream():  # also bounds chunked bodies with no length
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
    except ClientDisconnect:  # the client gave up mid-upload: not a server error (499, as nginx)
        raise APIError(499, "the client disconnected while sending the body") from None
    try:
        body = orjson.loads(b"".join(chunks))
    except orjson.JSONDecodeError as exc:
        raise APIError(400, f"malformed JSON body: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the JSON body must be an object", code="invalid_json")
    return body
