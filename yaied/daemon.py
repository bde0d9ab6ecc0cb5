"""The daemon: one engine behind the HTTP server, listening before the model has loaded.

``run_server`` binds at once, so probes get a 503 from ``/health`` (not a refused connection)
while the engine loads in a thread; systemd notify, signals and draining come later.
"""

from __future__ import annotations

import uvicorn

from yaied.config import EngineConfig
from yaied.server.app import build_app
from yaied.server.config import ServerConfig


def run_server(engine_config: EngineConfig, server_config: ServerConfig) -> None:
    def load_engine():  # runs in a thread from the app's lifespan
        from yaied.engine.async_engine import AsyncEngine  # torch loads here, not at import

        return AsyncEngine(engine_config, show_progress=False)

    app = build_app(server_config, load_engine, engine_config.model.model)
    uvicorn.run(
        app,
        host=server_config.host,
        port=server_config.port,
        log_level="info",
        timeout_graceful_shutdown=5,
    )
