"""The daemon: the engines behind the HTTP server, listening before the model has loaded.

``run_server`` binds at once, so probes get a 503 from ``/health`` (not a refused connection)
while the engine loads in a thread. It binds before anything loads: a port in use or a host that
does not resolve is an OSError (one line from the CLI), not a load nobody can reach. If loading
fails (unknown model, a pool too small for one context, ...) the server stops and the error
propagates to the caller, so `yaied serve` exits non-zero with a one-line message and systemd can
restart or report it.

Shutdown (SIGTERM or SIGINT) drains first:

    signal -> /health and new requests answer 503 -> in-flight requests finish
           -> (drain timeout) the rest are aborted with a final event -> uvicorn stops
           -> the engines stop -> exit 0

all within ``server.stop_timeout_seconds`` (server/shutdown.py spends it), below systemd's
TimeoutStopSec. A second signal skips what is left of the drain. A stop while the model still
loads (a long conversion) gives up on the load and exits without waiting for its thread.

Reload (SIGHUP, `systemctl reload yaied`): the config file is read again and its keys and
engines applied (server/reload.py), between RELOADING=1 and READY=1 to systemd.

A single engine that stops for good (see yaied/engine/faults.py) stops the server too, and
``run_server`` raises EngineDeadError: `yaied serve` then exits non-zero for its supervisor.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import socket
import sys
import time

import uvicorn

from yaied.core.config import EngineConfig
from yaied.core.errors import ListenError
from yaied.core.forwarding import is_loopback
from yaied.core.processes import freeze_loaded_objects
from yaied.router.autoscale import AutoscaleConfig
from yaied.router.config import EngineEntry, RouterConfig
from yaied.router.room import HostRoom, Weights
from yaied.server.app import build_app
from yaied.server.config import ServerConfig
from yaied.server.reload import ConfigReader, reload
from yaied.server.shutdown import StopClock
from yaied.systemd_notify import SystemdNotifier

log = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, with the first exit signal turned into a drain of the engine."""

    def __init__(
        self,
        config: uvicorn.Config,
        server_config: ServerConfig,
        read_config: ConfigReader | None = None,
    ) -> None:
        super().__init__(config)
        self.drain_timeout = server_config.drain_timeout_seconds
        self.stop_timeout = server_config.stop_timeout_seconds
        self.read_config = read_config
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self._reloading: asyncio.Task | None = None
        self._reload_again = False  # a SIGHUP came during a reload: one more follows it

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        # SIGHUP's default action ends the process: caught from the start, reload or not.
        self._loop.add_signal_handler(signal.SIGHUP, self._reload_soon)
        try:
            await super().serve(sockets)
        finally:
            self._loop.remove_signal_handler(signal.SIGHUP)
        state = getattr(self.config.app.state, "server", None)
        if state is not None and state.load_abandoned:
            # The load's threads (a conversion, the engine's worker) cannot be stopped, and the
            # interpreter would wait for them at exit. The engines are stopped; leave now.
            log.warning("exiting while the model was still loading")
            logging.shutdown()
            sys.stderr.flush()
            os._exit(0)

    def handle_exit(self, sig: int, frame: object) -> None:
        if self._draining or self._loop is None or self.should_exit:
            super().handle_exit(sig, frame)  # a second signal: stop now
            return
        self._draining = True
        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._drain(sig)))

    def _reload_soon(self) -> None:
        if self._reloading is not None and not self._reloading.done():
            # The file may have changed since that reload read it (a key revoked meanwhile):
            # read it once more when it ends, however many SIGHUPs come meanwhile.
            log.info("SIGHUP: a reload is running; the file is read again once it ends")
            self._reload_again = True
            return
        assert self._loop is not None
        self._reloading = self._loop.create_task(self._reload())
        self._reloading.add_done_callback(self._after_reload)

    def _after_reload(self, task: asyncio.Task) -> None:
        if self._reload_again and not task.cancelled() and not self._draining:
            self._reload_again = False
            self._reload_soon()

    async def _reload(self) -> None:
        server = getattr(self.config.app.state, "server", None)
        if self.read_config is None:
            log.warning("SIGHUP: this daemon has no config file to read again; ignored")
            return
        if server is None or server.manager is None:
            log.warning("SIGHUP: the engines are still loading; ignored")
            return  # READY=1 has not been sent either: systemd still waits for the start
        notifier = SystemdNotifier()
        notifier.notify(f"RELOADING=1\nMONOTONIC_USEC={time.monotonic_ns() // 1000}")
        log.info("SIGHUP: reloading the config")
        try:
            await reload(server, self.read_config)
        finally:
            notifier.notify("READY=1")

    async def _drain(self, sig: int) -> None:
        clock = StopClock(self.stop_timeout)
        server = getattr(self.config.app.state, "server", None)  # set by the app's lifespan
        if server is not None:
            server.stop_clock = clock  # the lifespan stops the engines in what is left
            drain = clock.drain_seconds(self.drain_timeout)
            log.info("draining: up to %.0f s for in-flight requests", drain)
            await server.drain(drain, clock.abort_wait_seconds())
        self.config.timeout_graceful_shutdown = clock.close_seconds()
        super().handle_exit(sig, None)


def run_server(
    engine_config: EngineConfig,
    server_config: ServerConfig,
    router_config: RouterConfig | None = None,
    engines: tuple[EngineEntry, ...] = (),
    read_config: ConfigReader | None = None,
    autoscale: AutoscaleConfig | None = None,
    weight_bytes: Weights = None,
) -> None:
    """Serve until a signal. One engine runs in this process unless `[[engines]]` entries or
    ``router.engines > 1`` ask for engine processes or remote daemons behind the router.
    ``read_config`` reads the config files again on SIGHUP (None: a reload changes nothing);
    ``autoscale`` turns the autoscaler on where it is enabled; ``weight_bytes``: the CLI's
    estimate of an engine's weights at its ranks (router/room.py's Weights), for the memory
    check of CPU engines added while serving."""
    failure: list[BaseException] = []
    server: DrainingServer | None = None
    router_config = router_config or RouterConfig()

    def load_engine():  # runs in a thread from the app's lifespan
        from yaied.engine.async_engine import AsyncEngine  # torch loads here, not at import
        from yaied.router.build import build_manager
        from yaied.router.manager import EngineManager

        if engines or router_config.engines > 1:
            manager = build_manager(engine_config, router_config, engines)
        else:
            engine = AsyncEngine(engine_config, show_progress=False)
            engine.on_dead = engine_died
            manager = EngineManager.single(engine, router_config)
        manager.autoscale = autoscale or manager.autoscale
        manager.room = HostRoom(weight_bytes)
        freeze_loaded_objects()
        return manager

    def load_failed(exc: BaseException) -> None:
        failure.append(exc)
        if server is not None:
            server.should_exit = True  # nothing to serve: stop listening

    def engine_died(exc: BaseException) -> None:
        # The one engine stopped for good (a hung step, a CUDA error, a failed rebuild) and has
        # failed every request. Nothing in this process can bring it back: exit non-zero, so
        # systemd, a container runtime or a shell loop starts a fresh daemon.
        from yaied.engine.faults import EngineDeadError

        failure.append(EngineDeadError(f"the engine stopped: {exc}"))
        if server is not None:
            server.should_exit = True

    app = build_app(
        server_config, load_engine, engine_config.model.model, on_load_failure=load_failed
    )
    sockets = listening_sockets(server_config.host, server_config.port)
    # uvicorn says where it listens only when it binds itself; /health is 503 until the load ends
    where = ", ".join(_address(sock) for sock in sockets)
    log.info("listening on %s; the model loads (GET /health is 503 until it is ready)", where)
    try:
        warn_if_exposed(server_config)
        config = uvicorn.Config(
            app,
            host=server_config.host,
            port=server_config.port,
            log_level="info",
            timeout_graceful_shutdown=5,  # a stop by signal sets its own (see _drain)
            # Connections and tasks at once: past it, 503 at once, not a daemon out of memory.
            limit_concurrency=server_config.limit_concurrency,
        )
        server = DrainingServer(config, server_config, read_config)
        # uvicorn re-raises the signal it caught under the handlers it found once it has
        # stopped. No-op handlers here make that harmless, so a stopped daemon exits 0, as
        # systemd expects.
        previous = {sig: signal.signal(sig, _ignore) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            server.run(sockets=sockets)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    finally:  # uvicorn closes them when it stops, not when it exits before (closing twice is fine)
        for sock in sockets:
            sock.close()
    if failure:
        raise failure[0]


def listening_sockets(host: str, port: int) -> list[socket.socket]:
    """Sockets bound to the addresses ``host`` resolves to, as uvicorn (asyncio) would bind
    them, or an OSError naming the address. uvicorn binds only after the app's startup, which
    begins the model's load, and reports a failed bind as log lines and exit code 3.

    As asyncio does, an address this machine cannot have is skipped while another binds: an
    address family the kernel lacks (IPv6 switched off, yet ``localhost`` resolves to ``::1``
    too), or an address not on any interface. A port in use is an error whatever else binds.

    A port in use, no address to bind and a resolver that failed for now are a ListenError (the
    CLI exits 1, which systemd retries: the holder may leave, the address come up); anything
    else (a name that does not resolve, a port this user may not bind) is a setting (exit 2)."""
    try:
        found = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except OSError as exc:
        error = ListenError if exc.errno == socket.EAI_AGAIN else OSError
        raise error(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    sockets: list[socket.socket] = []
    skipped: OSError | None = None
    try:
        for family, kind, proto, _, address in dict.fromkeys(found):
            try:
                sock = socket.socket(family, kind, proto)
            except OSError as exc:  # no such family here
                skipped = exc
                continue
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # "::" must not take the IPv4 port as well
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                if exc.errno != errno.EADDRNOTAVAIL:
                    raise
                skipped = exc
                sockets.pop().close()
        if not sockets:
            raise skipped or OSError(errno.EADDRNOTAVAIL, "no address to listen on")
    except OSError as exc:
        for sock in sockets:
            sock.close()
        error = ListenError if exc.errno in _FOR_NOW else OSError
        raise error(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    return sockets


# Bind errors that a later start may not meet: the port's holder leaves, the address comes up.
_FOR_NOW = (errno.EADDRINUSE, errno.EADDRNOTAVAIL)


def _address(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if sock.family == socket.AF_INET6 else f"http://{host}:{port}"


def warn_if_exposed(config: ServerConfig) -> bool:
    """A warning (and True) when the daemon listens beyond loopback with no API keys: anyone who
    reaches the port may run the model and cancel anyone's work."""
    if is_loopback(config.host) or config.api_keys:
        return False
    log.warning(
        "listening on %s without API keys: anyone who can reach port %d may use the model and "
        'cancel any request; set server.api_keys or server.api_key_file (README, "Limits and '
        'security")',
        config.host,
        config.port,
    )
    return True


def _ignore(signum: int, frame: object) -> None:
    pass
