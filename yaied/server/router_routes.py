"""The router's HTTP surface: cancel a request or a whole session (the engines: engines_routes.py).

    POST /v1/requests/{id}/cancel   every running call whose X-Request-Id is exactly id: each
                                    choice of it, and any other request that sent the same id
    POST /v1/sessions/{id}/cancel   every running request of an X-Session-Id (or `user`)
                                    (with API keys, both ids are the caller's key's own)

A cancelled request's stream ends with finish_reason "abort" once its engine has let it go, which
frees its KV pages within one engine step.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from yaied.core.ids import MAX_ID_CHARS
from yaied.server.auth import api_key_of
from yaied.server.errors import APIError, json_response
from yaied.server.keys import scoped_id
from yaied.server.state import ServerState


def _client_id(request: Request, name: str) -> str:
    """The path's id in the caller's key's namespace (server/keys.py): another key's requests
    and sessions are absent to it."""
    value = request.path_params[name]
    if len(value) > MAX_ID_CHARS:
        raise APIError(400, f"{name} may be at most {MAX_ID_CHARS} characters", param=name)
    return scoped_id(api_key_of(request), value)


async def cancel_request(request: Request) -> Response:
    server: ServerState = request.state.server
    manager = server.loaded_manager()
    request_id = request.path_params["request_id"]
    cancelled = await manager.cancel_client_request(_client_id(request, "request_id"))
    if not cancelled:
        raise APIError(404, f"no running request {request_id!r}", code="request_not_found")
    return json_response({"id": request_id, "object": "request.cancel", "cancelled": cancelled})


async def cancel_session(request: Request) -> Response:
    server: ServerState = request.state.server
    manager = server.loaded_manager()
    session_id = request.path_params["session_id"]
    cancelled = await manager.cancel_session(_client_id(request, "session_id"))
    return json_response({"id": session_id, "object": "session.cancel", "cancelled": cancelled})


def routes() -> list[Route]:
    return [
        Route("/v1/requests/{request_id}/cancel", cancel_request, methods=["POST"]),
        Route("/v1/sessions/{session_id}/cancel", cancel_session, methods=["POST"]),
    ]
