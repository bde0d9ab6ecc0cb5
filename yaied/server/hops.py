"""Who answers, and calls that came round again (yaied/core/forwarding.py says why).

One ASGI middleware, outside auth and the guard so that their refusals carry it too:

- every response carries ``X-Yaied-Instance``, the id of this daemon's engine manager (from the
  moment the manager exists, while its engines start), by which a router tells that a remote
  engine it was given is itself;
- a request whose ``X-Yaied-Via`` names this daemon (it forwarded the call, which came back:
  A -> B -> A, or A -> A under another name) or more than MAX_HOPS daemons gets 508 Loop
  Detected, code ``forwarding_loop``; the daemon that sent it moves the call to another engine.
"""

from __future__ import annotations

from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from yaied.core.forwarding import INSTANCE_HEADER, LOOP_CODE, VIA_HEADER, loop_in, parse_via
from yaied.server.errors import APIError

_VIA = VIA_HEADER.lower().encode("latin-1")
_INSTANCE = INSTANCE_HEADER.lower().encode("latin-1")


def instance_id(scope: Scope) -> str | None:
    """This daemon's id, once its manager exists (None while the loader builds it)."""
    server: Any = scope.get("state", {}).get("server")
    manager = None if server is None else (server.manager or server.starting)
    return None if manager is None else manager.instance_id


def via_of(headers: Any) -> tuple[str, ...]:
    """The daemons a request passed through (a Starlette request's headers)."""
    return parse_via(headers.get(VIA_HEADER))


class HopsMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        own = instance_id(scope) if scope["type"] == "http" else None
        if own is None:
            await self.app(scope, receive, send)
            return

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0] != _INSTANCE]
                message = {**message, "headers": [*headers, (_INSTANCE, own.encode())]}
            await send(message)

        via = parse_via(dict(scope["headers"]).get(_VIA, b"").decode("latin-1"))
        loop = loop_in(via, own)
        if loop is not None:
            refusal = APIError(508, loop, code=LOOP_CODE)
            await refusal.response()(scope, receive, send_with_id)
            return
        await self.app(scope, receive, send_with_id)
