"""The app-wide objects, held in Starlette's lifespan state (no module globals)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from yaied.core.errors import EngineStartError
from yaied.router.manager import EngineManager
from yaied.server.chat_output import ChatSettings
from yaied.server.config import ServerConfig
from yaied.server.errors import APIError
from yaied.server.keys import KeyTable
from yaied.server.metrics import ServerMetrics
from yaied.server.response_store import ResponseStore
from yaied.server.shutdown import StopClock

log = logging.getLogger(__name__)

# Blocking: run in a thread while the server listens. An engine is served alone (engine id "0");
# a manager is started on the event loop, then routes across its engines.
EngineLoader = Callable[[], Any]  # an EngineManager, or one AsyncEngine to serve alone
T = TypeVar("T")
# A request with more prompt characters or token ids than this is tokenized in a thread (about
# 5 ms of tokenizing: below it, the hop costs more than it saves).
OFF_LOOP_SIZE = 16_384


@dataclass(slots=True)
class RunningResponse:
    """A stored ``/v1/responses`` response whose call still runs, in the foreground or the
    background (responses_running.py): what GET reads meanwhile, and how DELETE, the cancel
    route and the daemon's stop end it."""

    cancel_calls: Callable[[], Awaitable[None]]
    # The response object as it stands, at a status (its output so far): what GET answers while
    # it runs, even once newer responses have pushed its stored object out of the store
    body: Callable[[str], dict[str, Any]]
    background: bool
    status: str = "in_progress"  # a background one's: "queued" until its first tokens
    task: asyncio.Task[None] | None = None  # a background one's own task: the stop cancels it
    cancelled: bool = False  # by POST /v1/responses/{id}/cancel: the status it ends with
    deleted: bool = False  # by DELETE: its end stores nothing
    ended: asyncio.Event = field(default_factory=asyncio.Event)  # its final object is kept


@dataclass(slots=True)
class ServerState:
    config: ServerConfig
    model_name: str
    manager: EngineManager | None = None
    load_error: BaseException | None = None
    draining: bool = False  # set on SIGTERM: health and new requests get 503
    stop_clock: StopClock | None = None  # set on SIGTERM: what is left of the stop's budget
    load_abandoned: bool = False  # stopped while the model loaded: its thread still runs
    starting: EngineManager | None = None  # the manager while its engines start
    keys: KeyTable = field(default_factory=KeyTable)  # the auth middleware's; a reload swaps them
    metrics: ServerMetrics = field(init=False)
    response_store: ResponseStore = field(init=False)  # /v1/responses with store (LRU, bounded)
    # stored responses still running, foreground or background, by (key namespace, response id)
    running_responses: dict[tuple[str, str], RunningResponse] = field(default_factory=dict)
    _chat: ChatSettings | None = None
    # Tokenizing and echo offsets of large requests (off_loop); shut down with the app.
    cpu_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="yaied-tokenize")
    )

    def __post_init__(self) -> None:
        config = self.config
        self.response_store = ResponseStore(
            config.responses_store_max, config.responses_store_max_bytes
        )
        self.metrics = ServerMetrics(
            self.model_name, self._stats, self._grammar_stats, self._pool_stats, self._listed
        )

    def _stats(self) -> dict[str, dict[str, int | float]] | None:
        return None if self.manager is None else self.manager.engine_stats()

    def _listed(self) -> tuple[set[str], dict[str, dict[str, int | float]]] | None:
        manager = self.manager
        if manager is None:
            return None
        return manager.listed_engines(), manager.removed_engine_counters()

    def _pool_stats(self) -> tuple[dict[str, int], dict[str, int], dict[str, int]] | None:
        manager = self.manager
        if manager is None:
            return None
        return manager.engine_counts(), manager.autoscale_events(), dict(manager.migrations)

    def _grammar_stats(self) -> dict[str, int | float] | None:
        inputs = None if self.manager is None else self.manager.inputs
        return None if inputs is None else inputs.grammars.stats()

    @property
    def engine(self) -> Any:
        """The in-process engine when the daemon runs one (tests reach the worker through it)."""
        handle = None if self.manager is None else self.manager.handles.get("0")
        return getattr(handle, "engine", None)

    async def load(self, loader: EngineLoader) -> bool:
        """Load and start the engines; whether they now serve (what systemd's READY=1 says):
        not when loading failed (``load_error``) or a stop began meanwhile."""
        try:
            loaded = await _in_daemon_thread(loader)
            single = not isinstance(loaded, EngineManager)
            manager = EngineManager.single(loaded) if single else loaded
            self.starting = manager  # a stop during start() stops its engines too
            manager.step_observer = self.metrics.observe_step
            await manager.start()
            manager.inputs.grammars.on_compile = self.metrics.observe_compile
        except Exception as exc:
            if isinstance(exc, ValueError | OSError | EngineStartError):
                # A setting or a file the user can fix, or an engine process killed while it
                # loaded: `yaied serve` prints it as one line, so the traceback is only for
                # --log-level debug, as the CLI's own.
                log.debug("loading the engine failed", exc_info=True)
            else:
                log.exception("loading the engine failed")
            self.load_error = exc
            return False
        self.manager = manager
        if self.draining:  # a stop came while it loaded: it waited for this, and now stops it
            log.info("the model loaded after the server began stopping; not serving it")
            return False
        info, config = manager.info, manager.engine_config
        log.info(
            "yaied ready: model %s (%s), %d engine(s) [%s], context %d, listening on http://%s:%d",
            self.model_name,
            config.model.model if config is not None else "?",
            len(manager.handles),
            ", ".join(f"{i}: {h.kind}" for i, h in manager.handles.items()),
            info.max_model_len,
            self.config.host,
            self.config.port,
        )
        return True

    @property
    def ready(self) -> bool:
        return self.manager is not None and self.manager.dead is None and not self.draining

    def loaded_manager(self) -> EngineManager:
        """The engine manager even while it drains or no engine is up: what acts on the calls
        already running (cancels) must reach them then too. A 503 only while loading."""
        if self.manager is None:
            reason = "failed to load" if self.load_error is not None else "is still loading"
            raise APIError(503, f"the model {reason}", code="engine_not_ready")
        return self.manager

    def ready_manager(self) -> EngineManager:
        """The engine manager, or a 503 saying why it cannot serve."""
        manager = self.loaded_manager()
        dead = manager.dead
        if dead is not None:
            # Not up, yet coming back (a process restarting or loading, a Ray actor placed again
            # when a node returns, a remote probed): "restarting". "dead" only when nothing
            # will bring one back (an engine added may). Either way a 503 to retry.
            recovering = manager.recovering
            raise APIError(
                503,
                f"the engines are restarting: {dead}"
                if recovering
                else f"the engine has stopped: {dead}",
                code="engine_restarting" if recovering else "engine_dead",
                headers={"Retry-After": str(self.config.retry_after_seconds)},
            )
        if self.draining:
            # a stop, not a fault: the client retries elsewhere, or here after a restart
            raise APIError(
                503,
                "the server is shutting down",
                code="draining",
                headers={"Retry-After": str(self.config.retry_after_seconds)},
            )
        return manager

    async def drain(self, timeout: float, abort_wait: float = 10.0) -> None:
        """Refuse new work, let in-flight requests finish for up to timeout seconds, then abort
        the rest (each gets its final event, so every stream ends properly) and wait up to
        ``abort_wait`` seconds for those events; a call whose engine sent none is ended then."""
        self.draining = True
        manager = self.manager
        if manager is None:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while manager.num_requests_in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if manager.num_requests_in_flight:
            log.warning("drain timeout: aborting %d requests", manager.num_requests_in_flight)
            manager.abort_all()
            deadline = loop.time() + abort_wait
            while manager.num_requests_in_flight and loop.time() < deadline:
                await asyncio.sleep(0.01)
            # An engine that never confirmed its aborts (hung): its streams end here, before
            # the server closes their connections, not cut off without a final event.
            if ended := manager.end_unanswered():
                log.warning("%d aborted requests got no answer from their engine; ended", ended)

    def chat_settings(self, manager: EngineManager) -> ChatSettings:
        """The model's tool-call format and reasoning parser, settled on first use (the chat
        template is known once the engine is)."""
        if self._chat is None:
            tokenizer = manager.tokenizer
            template = self.config.chat_template or getattr(tokenizer, "chat_template", None)
            self._chat = ChatSettings.resolve(
                template if isinstance(template, str) else None,
                self.config.tool_call_parser,
                self.config.reasoning_parser,
            )
            log.info("chat: tool calls in %s format", self._chat.tool_format)
        return self._chat

    async def stop(self, loading: asyncio.Task) -> None:
        """The app's last act: the engines stopped within what the stop's clock has left. A
        model still loading is waited for only so long; its thread cannot be stopped, so
        ``load_abandoned`` tells the daemon to exit without waiting for it."""
        clock = self.stop_clock or StopClock(60.0)  # stopped without a signal: tests, a failure
        if not loading.done():
            await asyncio.wait({loading}, timeout=clock.load_wait_seconds())
        if not loading.done():
            log.warning("stopping before the model finished loading; not waiting for it")
            self.load_abandoned = True
            loading.cancel()
            await asyncio.wait({loading})
        manager = self.manager or self.starting
        if manager is not None:
            await manager.stop(clock.left())
        # background responses: their calls ended with the engines; their tasks go too
        running = self.running_responses.values()
        tasks = [run.task for run in running if run.task is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def check_queue(self, manager: EngineManager, num_jobs: int = 1) -> None:
        """429 unless ``num_jobs`` more calls fit under server.max_queue_len waiting calls.
        Counted from the router's own calls, updated as each starts: called with no await
        between it and the submission, a burst cannot pass the check together. An empty queue
        takes any request (its size is bounded by max_jobs_per_request), so none waits forever."""
        limit = self.config.max_queue_len
        waiting = manager.num_calls_waiting
        if limit and waiting and waiting + num_jobs > limit:
            raise APIError(
                429,
                f"too many requests waiting ({limit} calls); retry later",
                code="queue_full",
                headers={"Retry-After": str(self.config.retry_after_seconds)},
            )

    async def off_loop(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the CPU thread when ``size`` (characters, token ids, or a body's
        bytes) is past OFF_LOOP_SIZE, else here: tokenizing a large request, or decoding and
        parsing a large body, must not stall every stream. One thread, so tokenizer calls never
        run concurrently with each other."""
        if size < OFF_LOOP_SIZE:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.cpu_pool, fn, *args)


async def _in_daemon_thread(function: Callable[[], Any]) -> Any:
    """``function()`` in a daemon thread: unlike asyncio.to_thread's pool, nothing waits for it
    at exit when a stop gives up on it (a model conversion cannot be interrupted)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(setter: Callable[[Any], None], value: Any) -> None:
        if not future.done():  # cancelled: nobody waits for the result
            setter(value)

    def run() -> None:
        try:
            result = function()
        except BaseException as exc:
            outcome = (future.set_exception, exc)
        else:
            outcome = (future.set_result, result)
        with contextlib.suppress(RuntimeError):  # the loop closed first
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=run, name="yaied-load", daemon=True).start()
    return await future
