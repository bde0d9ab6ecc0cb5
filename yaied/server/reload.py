"""A reload (SIGHUP, `systemctl reload yaied`): the config file read again, its engines and keys
applied, nothing else touched.

    read the file (TOML, [server], [router], [[engines]], the key file)   all or nothing:
      a config that does not load is logged and changes nothing
    keys      the table swapped in whole: the next request sees the new keys (whatever becomes
              of the engines: a key revoked never waits on an engine that cannot start)
    engines   all or nothing, a diff by name (router/pool.py apply_engines): new ones start,
              missing ones drain and stop once the new ones are up, changed ones are
              replaced, the rest untouched; new local CPU engines past the memory or cores
              left now: the pool stays as it was, and Ray is not started or joined for the
              new ray engines
    the rest  other settings take a restart: a reload that changes them says so in the log

The daemon tells systemd RELOADING=1 before and READY=1 after (daemon.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from yaied.core.config import load_config
from yaied.router.autoscale import AutoscaleConfig, load_autoscale_config
from yaied.router.build import local_entries
from yaied.router.config import EngineEntry, RouterConfig, load_router_config, refuse_own_address
from yaied.router.manager import EngineManager
from yaied.router.ray_cluster import join_for
from yaied.router.room import engine_device
from yaied.server.config import ServerConfig, load_server_config
from yaied.server.keys import KeyTable
from yaied.server.state import ServerState

log = logging.getLogger(__name__)
# Applied by a reload; every other setting of [server] and [router] takes a restart.
_RELOADED = ("api_keys", "api_key_file", "engines")


@dataclass(frozen=True, slots=True)
class DaemonConfig:
    """What a reload reads: the sections it applies, and the ones it only compares."""

    server: ServerConfig
    router: RouterConfig
    engines: tuple[EngineEntry, ...]  # the [[engines]] list
    autoscale: AutoscaleConfig  # read at start only


ConfigReader = Callable[[], DaemonConfig]  # reads the files again; raises when they do not load


def config_reader(
    path: str | None,
    server_flags: Mapping[str, Any],
    router_flags: Mapping[str, Any],
) -> ConfigReader:
    """The daemon's reader, at start and on SIGHUP: ``path`` under the command's flags. The
    engine's sections are not applied by a reload, only checked, so that a file broken anywhere
    changes nothing."""

    def read() -> DaemonConfig:
        load_config(path)
        server = load_server_config(path, overrides=server_flags)
        router, entries = load_router_config(path, overrides=router_flags)
        refuse_own_address(entries, server.host, server.port)
        return DaemonConfig(server, router, entries, load_autoscale_config(path))

    return read


async def reload(server: ServerState, read: ConfigReader) -> bool:
    """Apply the config file again; False (and a log line) when nothing could be applied."""
    manager = server.manager
    if manager is None or not manager.running or server.draining:
        log.warning("reload ignored: the daemon is starting or stopping")
        return False
    try:
        # The files are read off the event loop (a key file on a slow mount).
        config = await asyncio.to_thread(read)
        keys = KeyTable.parse(config.server.api_keys)
    except Exception as exc:  # a file that does not load: the daemon goes on as it was
        log.error("reload failed, nothing changed: %s", exc)
        return False
    # The keys apply whatever becomes of the engines: a key revoked must not wait on an
    # engine that cannot start (no room left, a Ray cluster away).
    server.keys.replace(keys)
    applied = f"{len(keys.keys)} API keys ({sum(key.admin for key in keys.keys)} admin)"
    try:
        diff = await _apply_engines(manager, config)
    except Exception as exc:  # whatever stops the engines' change, the pool stays as it was
        log.error("reload: %s applied; engines unchanged: %s", applied, exc)
    else:
        changes = ", ".join(f"{what} {names}" for what, names in diff.items() if names)
        log.info("reload: %s; engines %s", applied, changes or "unchanged")
    stale = _needs_restart(server.config, config.server, "server")
    stale += _needs_restart(manager.config, config.router, "router")
    if stale:
        log.warning("reload: %s changed; these take a restart", ", ".join(stale))
    return True


async def _apply_engines(manager: EngineManager, config: DaemonConfig) -> dict[str, list[str]]:
    """The file's [[engines]] (or ``router.engines`` local ones) as a diff by name; raises,
    changing nothing, when the new engines cannot be applied."""
    entries = config.engines
    if not entries and config.router.engines > 1 and manager.engine_config is not None:
        # As build_manager makes them at start, so named alike: a reload leaves them be.
        engine = manager.engine_config
        device, ranks = engine.device.device, engine.engine.tensor_parallel_size
        count, threads = config.router.engines, engine.device.threads
        # Local engine entries may ask torch how many GPUs there are: off the event loop.
        entries = await asyncio.to_thread(local_entries, count, device, ranks, threads)
    if any(e.kind == "local" for e in entries):  # device auto asks torch (the fit check)
        await asyncio.to_thread(engine_device, "auto")  # imported the first time: off the loop
    # apply_engines' checks (the new local CPU engines' fit among them) before Ray: a
    # reload that changes nothing starts or joins no Ray. apply_engines runs them again.
    manager.check_engines(entries)
    if manager.engine_config is not None:  # else apply_engines refuses ray engines
        # A new ray engine may start or join Ray (seconds): in a thread, before any change.
        known = [e.entry for e in manager.pool.values() if e.origin == "config"]
        new = [e for e in entries if e not in known]
        size = manager.engine_config.engine.tensor_parallel_size
        await join_for(manager.config.ray_address, new, size)
    return manager.apply_engines(entries)


def _needs_restart(old: object, new: object, section: str) -> list[str]:
    fields = [f.name for f in dataclasses.fields(old) if f.name not in _RELOADED]  # type: ignore[arg-type]
    return [f"{section}.{name}" for name in fields if getattr(old, name) != getattr(new, name)]
