"""The daemon: one engine behind the HTTP server, listening before the model has loaded.

``run_server`` binds at once, so probes get a 503 from ``/health`` (not a refused connection)
while the engine loads in a thread. If loading fails (unknown model, a pool too small for one
context, ...) the server stops and the error propagates to the caller, so `yaied serve` exits
non-zero with a one-line message and systemd can restart or report it. systemd notify, signals
with draining, and the watchdog come later.
"""

from __future__ import annotations

import signal

import uvicorn

from yaied.config import EngineConfig
from yaied.server.app import build_app
from yaied.server.config import ServerConfig


def run_server(engine_config: EngineConfig, server_config: ServerConfig) -> None:
    failure: list[BaseException] = []
    server: uvicorn.Server | None = None

    def load_engine():  # runs in a thread from the app's lifespan
        from yaied.engine.async_engine import AsyncEngine  # torch loads here, not at import

        try:
            return AsyncEngine(engine_config, show_progress=False)
        except BaseException as exc:
            failure.append(exc)
            if server is not None:
                server.should_exit = True  # nothing to serve: stop listening
            raise

    app = build_app(server_config, load_engine, engine_config.model.model)
    config = uvicorn.Config(
        app,
        host=server_config.host,
        port=server_config.port,
        log_level="info",
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)
    # uvicorn handles SIGINT/SIGTERM itself (graceful shutdown), then re-raises the signal it
    # caught under the handlers it found. No-op handlers here make that re-raise a no-op, so a
    # stopped daemon returns normally and exits 0, as systemd expects.
    previous = {sig: signal.signal(sig, _ignore) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if failure:
        raise failure[0]


def _ignore(signum: int, frame: object) -> None:
    pass
