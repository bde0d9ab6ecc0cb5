"""The app-wide objects, held in Starlette's lifespan state (no module globals)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from yaied.engine.async_engine import AsyncEngine
from yaied.server.config import ServerConfig
from yaied.server.errors import APIError
from yaied.server.metrics import ServerMetrics

log = logging.getLogger(__name__)

EngineLoader = Callable[[], AsyncEngine]  # blocking: run in a thread while the server listens


@dataclass(slots=True)
class ServerState:
    config: ServerConfig
    model_name: str
    engine: AsyncEngine | None = None
    load_error: BaseException | None = None
    draining: bool = False  # set on SIGTERM: health and new requests get 503
    metrics: ServerMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(self.model_name, self._stats)

    def _stats(self) -> dict[str, int | float] | None:
        return None if self.engine is None else self.engine.stats()

    async def load(self, loader: EngineLoader) -> None:
        try:
            engine = await asyncio.to_thread(loader)
        except Exception as exc:
            log.exception("loading the engine failed")
            self.load_error = exc
            return
        engine.step_observer = self.metrics.iteration_tokens.observe
        self.engine = engine
        info = engine.info
        log.info(
            "yaied ready: model %s (%s), %s on %s, %d KV pages of %d tokens, context %d, "
            "listening on http://%s:%d",
            self.model_name,
            engine.config.model.model,
            info.dtype,
            info.device,
            info.num_pages,
            info.page_size,
            info.max_model_len,
            self.config.host,
            self.config.port,
        )

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.engine.dead is None and not self.draining

    def ready_engine(self) -> AsyncEngine:
        """The engine, or a 503 saying why there is none."""
        if self.engine is None:
            reason = "failed to load" if self.load_error is not None else "is still loading"
            raise APIError(503, f"the model {reason}", code="engine_not_ready")
        if self.engine.dead is not None:
            raise APIError(503, f"the engine has stopped: {self.engine.dead}", code="engine_dead")
        if self.draining:
            raise APIError(503, "the server is shutting down", code="draining")
        return self.engine

    async def drain(self, timeout: float) -> None:
        """Refuse new work, let in-flight requests finish for up to timeout seconds, then abort
        the rest (each gets its final event, so every stream ends properly)."""
        self.draining = True
        engine = self.engine
        if engine is None:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while engine.num_requests_in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if engine.num_requests_in_flight:
            log.warning("drain timeout: aborting %d requests", engine.num_requests_in_flight)
            engine.abort_all()
            while engine.num_requests_in_flight and engine.dead is None:
                await asyncio.sleep(0.01)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def check_queue(self, engine: AsyncEngine) -> None:
        limit = self.config.max_queue_len
        if limit and engine.stats()["num_requests_waiting"] >= limit:
            raise APIError(
                429,
                f"too many requests waiting ({limit}); retry later",
                code="queue_full",
                headers={"Retry-After": str(self.config.retry_after_seconds)},
            )
