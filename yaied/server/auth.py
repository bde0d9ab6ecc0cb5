"""Who is calling: the API key check, and each key's bound on generation requests in flight.

With keys set, a request must carry ``Authorization: Bearer <secret>`` (or Anthropic's
``x-api-key: <secret>``) of a key in the table
(server/keys.py), else 401. The key found is put in the request's state (``api_key_of``), where
the routes read it to namespace ids and decide whether ``priority`` counts. A key past its
``max_in_flight`` generation requests gets 429 with Retry-After; the count drops when a
response has been sent in full (a stream: at its end), however it ended. A background response
(``/v1/responses`` with ``background``) counts until its call ends (responses_api.py).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from yaied.server.errors import APIError
from yaied.server.keys import ApiKey, KeyTable

# Paths that need no key even when keys are configured: probes and scrapers stay open.
OPEN_PATHS = ("/health", "/metrics", "/openapi.json")
# What max_in_flight counts: work on the engines (cancel and the rest stay free, so a key at its
# bound can still cancel its own requests).
GENERATION_PATHS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/embeddings",
)
_STATE_KEY = "api_key"


def api_key_of(request: Request) -> ApiKey | None:
    """The caller's key; None when the daemon has no keys."""
    return request.scope.get("state", {}).get(_STATE_KEY)


def may_set_priority(request: Request) -> bool:
    key = api_key_of(request)
    return key is None or key.may_set_priority


class AuthMiddleware:
    def __init__(self, app: ASGIApp, keys: KeyTable, retry_after_seconds: int = 1) -> None:
        self.app = app
        self.keys = keys
        self.retry_after = str(retry_after_seconds)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys.enabled or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        given = headers.get(b"authorization", b"")
        token = given[7:] if given[:7].lower() == b"bearer " else b""
        # Anthropic's clients send x-api-key instead (the same keys: one table for every API).
        token = token or headers.get(b"x-api-key", b"")
        key = self.keys.lookup(token)
        if key is None:
            error = APIError(401, "missing or invalid API key", code="invalid_api_key")
            response = error.response()
            response.headers["WWW-Authenticate"] = "Bearer"
            await response(scope, receive, send)
            return
        scope.setdefault("state", {})[_STATE_KEY] = key
        if scope["path"] not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        if key.max_in_flight and self.keys.in_flight[key.name] >= key.max_in_flight:
            error = APIError(
                429,
                f"this key has {key.max_in_flight} requests in flight, its limit; retry later",
                code="key_in_flight_limit",
                headers={"Retry-After": self.retry_after},
            )
            await error.response()(scope, receive, send)
            return
        self.keys.hold(key.name)
        try:
            await self.app(scope, receive, send)
        finally:
            self.keys.release(key.name)
