"""The engine pool over HTTP: list the engines, and (with an admin key) add, drain and remove.

    GET    /v1/engines              every engine: id, name, kind, state, health, load, hit rate;
                                    recently removed ones too (state "removed")
    POST   /v1/engines              add one: {"kind": "local", "device": ..., "threads": ...} or
                                    {"kind": "remote", "url": ..., "api_key": ...}, and "name";
                                    202, it takes calls once its state is "up"; 400 for
                                    a remote that is this daemon (core/forwarding.py); 409
                                    (engine_name_taken) for a name a serving engine holds;
                                    409 (insufficient_memory, insufficient_cores) for a local
                                    CPU engine this machine cannot hold now (router/room.py)
    POST   /v1/engines/{id}/drain   no new calls go there; in-flight ones finish
    DELETE /v1/engines/{id}?timeout=30
                                    drain, then stop it after its calls finish (or the timeout);
                                    202, its state goes "draining", then "removed"

``{id}`` is an engine's id or its name. The three changes need a key marked ``admin`` in the
key table (server/keys.py): any other key gets 403, and so does everyone when the daemon has no
keys at all: a daemon without keys has no way to tell an operator from a client. Each change is
logged with the key's name.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from yaied.router.config import EngineEntry, parse_engine_entry, refuse_own_address
from yaied.router.manager import EngineManager
from yaied.router.names import base_name
from yaied.router.pool import EngineNameTaken
from yaied.router.ray_cluster import join_for
from yaied.router.remote import instance_at
from yaied.router.room import NoRoom, check_room, engine_device
from yaied.server.auth import api_key_of
from yaied.server.body import read_json
from yaied.server.errors import APIError, json_response
from yaied.server.state import ServerState

log = logging.getLogger(__name__)
DEFAULT_REMOVE_TIMEOUT = 30.0  # seconds the calls on a removed engine get to finish
# Settings an HTTP caller may give a new engine: whatever an [[engines]] table takes, less the
# two that read the daemon's own environment and files (an admin key must not turn them into a
# way of sending a file's first line to a URL of its choosing).
_REFUSED_FIELDS = ("api_key_env", "api_key_file")


def _admin(request: Request) -> str:
    """The admin key's name, else 403."""
    key = api_key_of(request)
    if key is None or not key.admin:
        raise APIError(
            403, "changing the engines needs an API key marked admin", code="admin_key_required"
        )
    return key.name


def _manager(request: Request) -> EngineManager:
    """The manager, even when no engine is up (adding one is how that is mended)."""
    server: ServerState = request.state.server
    if server.manager is None:
        raise APIError(503, "the engines are still loading", code="engine_not_ready")
    if server.draining:
        raise APIError(503, "the server is shutting down", code="draining")
    return server.manager


def _engine_id(manager: EngineManager, request: Request) -> str:
    try:
        return manager.find_engine(request.path_params["engine_id"])
    except ValueError as exc:
        raise APIError(404, str(exc), param="engine_id", code="engine_not_found") from None


def _status(manager: EngineManager, engine_id: str) -> dict[str, Any]:
    if engine_id in manager.removed:
        return manager.removed[engine_id]
    return manager.get_engine_status(engine_id).as_json()


def engine_entry(body: dict[str, Any]) -> EngineEntry:
    """A POST body as an [[engines]] entry; 400 names what is wrong."""
    known = [f.name for f in dataclasses.fields(EngineEntry) if f.init]
    for name in body:
        if name in _REFUSED_FIELDS:
            raise APIError(400, f"{name} is for the config file; send api_key", param=name)
        if name not in known:
            raise APIError(400, f"unknown engine setting {name!r}", param=name)
    try:
        return parse_engine_entry(body)
    except ValueError as exc:
        raise APIError(400, str(exc)) from None


async def list_engines(request: Request) -> Response:
    server: ServerState = request.state.server
    if server.manager is None:
        raise APIError(503, "the engines are still loading", code="engine_not_ready")
    manager = server.manager
    data = manager.engine_listing()
    return json_response({"object": "list", "policy": manager.config.policy, "data": data})


async def add_engine(request: Request) -> Response:
    who = _admin(request)
    manager = _manager(request)
    entry = engine_entry(await read_json(request))
    await _refuse_self(request, manager, entry)
    await _check_ray(manager, entry)
    if entry.kind == "local":  # device auto asks torch, imported the first time: off the loop
        await asyncio.to_thread(engine_device, "auto")
        _check_room(manager, entry)
    try:
        engine_id = manager.add_engine(entry, name=entry.name or None, origin="api")
    except EngineNameTaken as exc:
        raise APIError(409, str(exc), param="name", code="engine_name_taken") from None
    except ValueError as exc:
        raise APIError(400, str(exc)) from None
    log.info("engines: key %s added engine %s (%s)", who, engine_id, manager.pool[engine_id].name)
    return json_response(_status(manager, engine_id), 202)


async def drain_engine(request: Request) -> Response:
    who = _admin(request)
    manager = _manager(request)
    engine_id = _engine_id(manager, request)
    _refuse_last(manager, engine_id)
    manager.drain_engine(engine_id)
    log.info("engines: key %s drains engine %s", who, engine_id)
    return json_response(_status(manager, engine_id))


async def remove_engine(request: Request) -> Response:
    who = _admin(request)
    manager = _manager(request)
    engine_id = _engine_id(manager, request)
    raw = request.query_params.get("timeout", str(DEFAULT_REMOVE_TIMEOUT))
    try:
        timeout = float(raw)
    except ValueError:
        timeout = -1.0
    if not 0 <= timeout <= 3600:
        raise APIError(400, "timeout is seconds, 0 to 3600", param="timeout")
    if engine_id not in manager.removed:
        _refuse_last(manager, engine_id)
        manager.start_removal(engine_id, timeout)
        log.info("engines: key %s removes engine %s (timeout %g s)", who, engine_id, timeout)
    return json_response(_status(manager, engine_id), 202)


async def _check_ray(manager: EngineManager, entry: EngineEntry) -> None:
    """A ray engine: join the cluster (the first one starts or joins Ray, for seconds) and
    check its resources in a thread, so the streams and probes on the event loop go on."""
    if entry.kind != "ray" or manager.engine_config is None:
        return  # add_engine refuses it, with its reason
    size = manager.engine_config.engine.tensor_parallel_size
    try:
        await join_for(manager.config.ray_address, [entry], size)
    except ValueError as exc:
        raise APIError(400, str(exc)) from None


def _check_room(manager: EngineManager, entry: EngineEntry) -> None:
    """409 for a local CPU engine past the memory or the cores this machine has left now, as a
    start past them is refused: started, the OOM killer would end one engine mid-serve."""
    name = base_name(entry)  # its name, else what it is (local-cpu)
    fix = (
        "the memory in use first (remove an engine), or at a restart cache.kv_cache_gib "
        "(--kv-cache-gib) or model.quantization"
    )
    try:
        warning = check_room(
            manager, {name: entry}, f"engine {name} added", fix, where="the body's threads"
        )
    except NoRoom as exc:
        raise APIError(409, str(exc), code=f"insufficient_{exc.resource}") from None
    if warning:
        log.warning("engines: %s", warning)


async def _refuse_self(request: Request, manager: EngineManager, entry: EngineEntry) -> None:
    """400 for a remote engine that is this daemon: its address, or (another name for it) a
    daemon that answers with this one's instance id. One that does not answer now is added, and
    its handle checks the same once it does."""
    if entry.kind != "remote":
        return
    config = request.state.server.config
    try:
        refuse_own_address([entry], config.host, config.port)
    except ValueError as exc:
        raise APIError(400, str(exc), param="url") from None
    if await instance_at(entry.url, entry.key) == manager.instance_id:
        raise APIError(
            400,
            f"remote engine {entry.url} is this daemon itself: its calls would come back here "
            "in a loop; give another yaied daemon's URL",
            param="url",
        )


def _refuse_last(manager: EngineManager, engine_id: str) -> None:
    """An operator's slip should not take the whole service down: the last engine serving (up,
    not draining) stays until another serves. A replacement still starting, or a dead one
    restarting, serves nothing yet; an engine that does not serve itself may always go."""
    if engine_id not in manager.pool or not manager.routable(engine_id):
        return
    if not any(manager.routable(i) for i in manager.pool if i != engine_id):
        starting = [i for i in manager.pool if manager.engine_state(i) == "starting"]
        wait = f"; wait until engine {starting[0]} is up" if starting else ""
        raise APIError(
            409,
            f"engine {engine_id} is the last one serving; add another first{wait}",
            code="last_engine",
        )


def routes() -> list[Route]:
    return [
        Route("/v1/engines", list_engines, methods=["GET"]),
        Route("/v1/engines", add_engine, methods=["POST"]),
        Route("/v1/engines/{engine_id}/drain", drain_engine, methods=["POST"]),
        Route("/v1/engines/{engine_id}", remove_engine, methods=["DELETE"]),
    ]
