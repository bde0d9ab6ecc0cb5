"""The Starlette app: routes, auth, body limits and OpenAI-style errors.

``build_app(server_config, load_engine, model_name)`` returns an app that listens at once; its
lifespan loads the engine in a thread (``/health`` is 503 until then) and shuts it down at exit.
Every app-wide object lives in the lifespan state (``request.state.server``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from yaied.core.forwarding import is_loopback
from yaied.server import (
    conversations_api,
    embeddings,
    engines_routes,
    generate,
    messages_api,
    responses_api,
    router_routes,
)
from yaied.server.auth import AuthMiddleware
from yaied.server.body import read_json
from yaied.server.chat_protocol import parse_template_options
from yaied.server.config import ServerConfig
from yaied.server.error_shape import AnthropicErrors
from yaied.server.errors import APIError, error_body, from_value_error, json_response
from yaied.server.guard import GuardMiddleware
from yaied.server.hops import HopsMiddleware
from yaied.server.keys import KeyTable
from yaied.server.openapi import openapi_schema
from yaied.server.protocol import parse_detokenize, parse_tokenize
from yaied.server.state import EngineLoader, ServerState
from yaied.server.tool_request import parse_tool_request
from yaied.systemd_notify import SystemdNotifier

log = logging.getLogger(__name__)
VERSION = "0.1.0"


async def health(request: Request) -> Response:
    server: ServerState = request.state.server
    if server.ready:
        # Probes read the status code; people read which CPU code runs (yaied/kernels/cpu_isa.py).
        return json_response({"status": "ok", **server.manager.hardware()})
    try:
        server.ready_manager()
    except APIError as exc:
        # Probes read the status code; people read the state in a word beside the error.
        body = {"status": HEALTH_STATES.get(str(exc.code), "unavailable"), **exc.body()}
        return json_response(body, exc.status, exc.headers)
    return Response(status_code=503)


# /health's "status" while it answers 503, by the error's code (server/state.py).
HEALTH_STATES = {
    "engine_not_ready": "starting",  # the model loads (or failed to: the message says)
    "engine_restarting": "restarting",  # no engine up, one on its way back
    "engine_dead": "dead",  # no engine up, none coming back
    "draining": "draining",  # a stop
}


async def models(request: Request) -> Response:
    server: ServerState = request.state.server
    card = {"id": server.model_name, "object": "model", "created": 0, "owned_by": "yaied"}
    if server.manager is not None:
        card["max_model_len"] = server.manager.info.max_model_len
    return json_response({"object": "list", "data": [card]})


async def metrics(request: Request) -> Response:
    server: ServerState = request.state.server
    return Response(server.metrics.render(), media_type="text/plain; version=0.0.4")


async def openapi(request: Request) -> Response:
    return json_response(openapi_schema(VERSION))


async def tokenize(request: Request) -> Response:
    server: ServerState = request.state.server
    manager = server.ready_manager()
    body = await read_json(request)
    server.check_model(body.get("model"))
    tokenizer = manager.tokenizer
    if tokenizer is None:
        raise APIError(400, "this model has no tokenizer")
    prompts, messages, special = parse_tokenize(body)
    if messages:
        options = parse_template_options(body)
        try:
            tokens, _ = manager.inputs.chat_prompt(
                messages,
                server.config.chat_template,
                add_generation_prompt=options.add_generation_prompt,
                continue_final_message=options.continue_final_message,
                template_kwargs=options.kwargs,
                tools=parse_tool_request(body).definitions() or None,
                tool_format=server.chat_settings(manager).tool_format,
            )
        except ValueError as exc:
            raise from_value_error(exc) from None
    else:  # a large prompt is tokenized in the CPU thread, as the generation endpoints do
        encode = functools.partial(tokenizer.encode, add_special_tokens=special)
        tokens = await server.off_loop(len(prompts[0]), encode, prompts[0])
    max_len = manager.info.max_model_len
    return json_response({"tokens": tokens, "count": len(tokens), "max_model_len": max_len})


async def tokenizer_info(request: Request) -> Response:
    """The served tokenizer's special tokens and chat template, as vLLM's endpoint gives them:
    with /tokenize and /detokenize, what a client needs to tokenize through the server (lm-eval's
    remote tokenizer) instead of loading the model's files itself."""
    server: ServerState = request.state.server
    manager = server.ready_manager()
    tokenizer = manager.tokenizer
    if tokenizer is None:
        raise APIError(400, "this model has no tokenizer")
    info: dict[str, Any] = {"tokenizer_class": type(tokenizer).__name__}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        token = getattr(tokenizer, name, None)
        info[name] = token if isinstance(token, str) else None
    template = server.config.chat_template or getattr(tokenizer, "chat_template", None)
    info["chat_template"] = template if isinstance(template, str) else None
    info["model_max_length"] = manager.info.max_model_len
    return json_response(info)


async def detokenize(request: Request) -> Response:
    server: ServerState = request.state.server
    manager = server.ready_manager()
    body = await read_json(request)
    server.check_model(body.get("model"))
    tokens = parse_detokenize(body)
    if manager.tokenizer is None:
        raise APIError(400, "this model has no tokenizer")
    vocab = manager.info.vocab_size
    if any(not 0 <= t < vocab for t in tokens):
        raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
    text = await server.off_loop(len(tokens), manager.tokenizer.decode, tokens)
    return json_response({"prompt": text})


def _with_request_id(request: Request, response: Response) -> Response:
    request_id = getattr(request.state, "request_id", None)
    if request_id:
        response.headers["X-Request-Id"] = request_id
    return response


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    if exc.status >= 500:
        log.warning("%s %s: %s", request.method, request.url.path, exc.message)
    server = getattr(request.state, "server", None)
    if exc.status == 503 and "Retry-After" not in exc.headers and server is not None:
        # every 503 is "not now" (loading, no engine up that holds the call): say when to retry
        exc.headers["Retry-After"] = str(server.config.retry_after_seconds)
    return _with_request_id(request, exc.response())


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    message = exc.detail if exc.status_code != 404 else f"no route {request.url.path}"
    return json_response(error_body(exc.status_code, message), exc.status_code, exc.headers)


async def _server_error(request: Request, exc: Exception) -> Response:
    # The exception's text is ours, not the client's: it goes to the log, under the request id.
    request_id = getattr(request.state, "request_id", None) or "-"
    log.exception("%s %s failed (request id %s)", request.method, request.url.path, request_id)
    message = f"internal error; the server log has it under request id {request_id}"
    return _with_request_id(request, json_response(error_body(500, message), 500))


def build_app(
    config: ServerConfig,
    load_engine: EngineLoader,
    model_name: str,
    *,
    on_load_failure: Callable[[BaseException], None] | None = None,
) -> Starlette:
    served = config.served_model_name or model_name

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Any]]:
        import asyncio

        server = ServerState(config, served, keys=keys)
        notifier = SystemdNotifier()

        async def load_then_notify() -> None:
            if await server.load(load_engine):  # not after a failure, nor after STOPPING=1
                notifier.notify("READY=1")
            elif on_load_failure is not None and server.load_error is not None:
                on_load_failure(server.load_error)  # systemd's Type=notify: started means loaded

        app.state.server = server  # the daemon drains through it on SIGTERM
        loading = asyncio.create_task(load_then_notify(), name="yaied-load")
        # Fed only while the engines serve and their steps advance: a dead or hung engine gets
        # the service restarted.
        watchdog = asyncio.create_task(
            notifier.feed_watchdog(lambda: server.ready and server.manager.progressing())
        )
        try:
            yield {"server": server}
        finally:
            notifier.notify("STOPPING=1")
            watchdog.cancel()
            await server.stop(loading)
            server.cpu_pool.shutdown(wait=False, cancel_futures=True)

    routes = [
        Route("/v1/completions", generate.completions, methods=["POST"]),
        Route("/v1/chat/completions", generate.chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/tokenizer_info", tokenizer_info, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
        *responses_api.routes(),
        *conversations_api.routes(),
        *messages_api.routes(),
        *embeddings.routes(),
        *router_routes.routes(),
        *engines_routes.routes(),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={
            APIError: _api_error,
            HTTPException: _http_error,
            Exception: _server_error,
        },
    )
    keys = KeyTable.parse(config.api_keys)
    app.add_middleware(AuthMiddleware, keys=keys, retry_after_seconds=config.retry_after_seconds)
    app.add_middleware(
        GuardMiddleware,
        loopback_only=is_loopback(config.host),
        allowed_origins=config.cors_allow_origins,
        send_timeout=config.send_timeout_seconds,
    )
    app.add_middleware(HopsMiddleware)  # this daemon's id on every answer; loops refused
    app.add_middleware(AnthropicErrors)  # outside the guard and auth: their refusals too
    if config.cors_allow_origins:  # off by default: browsers on other sites get no access
        # Outside auth and the guard, so preflights (which carry no key) are answered, and
        # 401s and 4xx refusals carry CORS.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.cors_allow_origins),
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=[
                "Authorization",
                "Content-Type",
                "X-Request-Id",
                "X-Session-Id",
                "X-Api-Key",
                "Anthropic-Version",
            ],
            expose_headers=["X-Request-Id", "Retry-After"],
        )
    return app
