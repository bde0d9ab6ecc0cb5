"""What every HTTP request must look like before any route sees it, and how long a send may take.

One ASGI middleware, outermost but CORS, checking in order:

- **Host** (DNS rebinding): bound to a loopback address, the daemon answers only requests whose
  Host is a loopback name. A web page whose own name an attacker re-pointed at 127.0.0.1 sends
  its own name as Host, and gets 400.
- **Origin** (cross-site requests): a browser POST from another site (an Origin that is
  neither this Host nor one of ``server.cors_allow_origins``) gets 403, so a page cannot even
  POST a body-less cancel.
- **Content-Type**: a POST with a body must be ``application/json``, else 415. Browsers send
  other types cross-site without asking first; JSON needs a CORS preflight.
- **Client ids**: ``X-Request-Id`` and ``X-Session-Id`` of more than MAX_ID_CHARS characters get
  400 (they live in tables and logs; the body's ``user`` is checked with the body).

Every send (a response's start, each body chunk, each SSE event) must finish within
``server.send_timeout_seconds``: a client that stops reading holds its stream's calls only that
long, then the connection is closed and its calls are cancelled.
"""

from __future__ import annotations

import asyncio
import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from yaied.core.forwarding import is_loopback
from yaied.core.ids import MAX_ID_CHARS
from yaied.server.errors import APIError

log = logging.getLogger(__name__)

_ID_HEADERS = (b"x-request-id", b"x-session-id")


class SendTimeout(TimeoutError):
    """A client did not take a response's bytes within the send timeout."""


def _host_name(value: str) -> str:
    """The name in a Host header or an Origin's authority, without the port."""
    value = value.rpartition("//")[2]  # an Origin: scheme://host[:port]
    if value.startswith("["):  # [v6]:port
        return value[1 : value.find("]")]
    return value.rpartition(":")[0] if value.count(":") == 1 else value


class GuardMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        *,
        loopback_only: bool,
        allowed_origins: tuple[str, ...] = (),
        send_timeout: float = 30.0,
    ) -> None:
        self.app = app
        self.loopback_only = loopback_only
        self.allowed_origins = set(allowed_origins)
        self.send_timeout = send_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope)
        if refusal is not None:
            await refusal.response()(scope, receive, send)
            return
        try:
            await self.app(scope, receive, self._timed(send, scope))
        except SendTimeout:
            # The response started and cannot end properly: uvicorn closes the connection. The
            # stream's calls were cancelled on the way out (its reader left).
            log.warning("%s %s: client stopped reading; closed", scope["method"], scope["path"])

    def _timed(self, send: Send, scope: Scope) -> Send:
        timeout = self.send_timeout

        async def timed_send(message: Message) -> None:
            try:
                async with asyncio.timeout(timeout):
                    await send(message)
            except TimeoutError:
                raise SendTimeout(f"send took more than {timeout} s") from None

        return timed_send

    def _refusal(self, scope: Scope) -> APIError | None:
        headers = dict(scope["headers"])
        host = headers.get(b"host", b"").decode("latin-1")
        if self.loopback_only and host and not is_loopback(_host_name(host)):
            return APIError(
                400,
                "this server listens on loopback only and answers loopback host names only",
                code="invalid_host",
            )
        origin = headers.get(b"origin", b"").decode("latin-1")
        # Reads (GET) change nothing, and a browser shows another site nothing without CORS.
        # "null" (sandboxed frames, file:// pages) is never trusted.
        writes = scope["method"] not in ("GET", "HEAD", "OPTIONS")
        if writes and origin and (origin == "null" or not self._origin_allowed(origin, host)):
            return APIError(403, "cross-site requests are not allowed", code="forbidden_origin")
        if scope["method"] == "POST" and _has_body(headers):
            kind = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            if kind != b"application/json":
                return APIError(
                    415, "request bodies must be application/json", code="unsupported_media_type"
                )
        for name in _ID_HEADERS:
            value = headers.get(name)
            if value is not None and len(value) > MAX_ID_CHARS:
                header = name.decode().title()
                return APIError(
                    400, f"{header} may be at most {MAX_ID_CHARS} characters", param=header
                )
        return None

    def _origin_allowed(self, origin: str, host: str) -> bool:
        if "*" in self.allowed_origins or origin in self.allowed_origins:
            return True
        return bool(host) and origin.rpartition("//")[2].lower() == host.lower()


def _has_body(headers: dict[bytes, bytes]) -> bool:
    length = headers.get(b"content-length")
    if length is not None:
        return length.strip() not in (b"", b"0")
    return b"transfer-encoding" in headers
