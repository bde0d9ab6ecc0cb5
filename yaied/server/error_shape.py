"""Anthropic's error shape on ``/v1/messages`` routes, whoever refused the request.

Errors are made in many places (the guard and auth middlewares, body reading, the routes,
Starlette's 404 and 405), all in OpenAI's shape. Anthropic's clients read
``{"type": "error", "error": {"type": ..., "message": ...}}``, so this outermost middleware
rewrites any JSON error answer under the Messages routes into that shape: one place, every
error, and nothing else changes. Streams (status 200) pass through untouched; a stream's own
errors are written in Anthropic's shape by server/messages_api.py.
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

MESSAGES_PREFIX = "/v1/messages"
# Status -> Anthropic's error type (docs.anthropic.com "Errors").
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    kind = ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _rewrite(status: int, body: bytes) -> bytes:
    try:
        error = orjson.loads(body)["error"]
        message = str(error["message"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return body
    return orjson.dumps(anthropic_error(status, message))


class AnthropicErrors:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if not (path == MESSAGES_PREFIX or path.startswith(MESSAGES_PREFIX + "/")):
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        parts: list[bytes] = []

        async def rewriting_send(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers", []))
                is_json = headers.get(b"content-type", b"").startswith(b"application/json")
                if message["status"] >= 400 and is_json:
                    start = message  # held until the whole (small) body is here
                    return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            parts.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = _rewrite(start["status"], b"".join(parts))
            headers = [(k, v) for k, v in start.get("headers", []) if k != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, rewriting_send)
