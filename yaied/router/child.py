"""The engine process's side of router/local_process.py: an AsyncEngine serving three pipes.

This module must not import torch at the top: the child sets ``CUDA_VISIBLE_DEVICES`` and the
thread count first, then imports the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import signal
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from yaied.core.config import EngineConfig
from yaied.core.processes import exit_with_parent, freeze_loaded_objects, private_progress_lock
from yaied.core.request import FinishReason, TokenEvent

if TYPE_CHECKING:
    from yaied.engine.async_engine import AsyncEngine

log = logging.getLogger(__name__)
_STOP = object()
STATS_INTERVAL = 0.2  # seconds between the child's stats reports
_MAX_EARLY_ABORTS = 4096  # aborts that overtook their submission, remembered until it comes
EXIT_ENGINE_DEAD = 3  # the child's exit status when its engine stopped for good


@dataclass(frozen=True, slots=True)
class ChildSpec:
    engine_id: str
    engine_config: EngineConfig
    visible_device: str | None  # CUDA_VISIBLE_DEVICES for the child, None: inherit
    threads: int


class Sender:
    """Writes to a pipe from its own thread, so the caller never blocks on a full pipe."""

    def __init__(self, conn: Connection, name: str) -> None:
        self._conn = conn
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, message: Any) -> None:
        self._queue.put(message)

    def close(self) -> None:
        self._queue.put(_STOP)

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            while (message := self._queue.get()) is not _STOP:
                self._conn.send(message)
        except OSError:
            pass  # the other side is gone; its reader learns that from end-of-file
        finally:
            self._conn.close()


def child_main(
    spec: ChildSpec, submit_conn: Connection, abort_conn: Connection, event_conn: Connection
) -> None:
    if spec.visible_device is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = spec.visible_device
    os.environ["OMP_NUM_THREADS"] = str(spec.threads)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C hits the group; the router decides
    logging.basicConfig(level=logging.WARNING, format=f"engine {spec.engine_id}: %(message)s")
    exit_with_parent("yaied-parent-watch")  # never outlive the parent, even mid-load
    private_progress_lock()  # no semaphore the os._exit below would leave behind
    sender = Sender(event_conn, "yaied-child-events")
    try:
        from yaied.engine.async_engine import AsyncEngine  # torch and CUDA start here

        engine = AsyncEngine(spec.engine_config, show_progress=False)
    except BaseException as exc:
        # A ValueError or OSError is a setting or a file the user can fix (the daemon's own
        # engine raises the same): the router raises it as such, for one line from the CLI.
        user_error = isinstance(exc, ValueError | OSError)
        sender.put(
            ("failed", str(exc) if user_error else f"{type(exc).__name__}: {exc}", user_error)
        )
        sender.close()
        sender.join(10)
        return
    # systemd's stop sends SIGTERM to every process of the service: while loading, it ends this
    # one at once (nothing to finish); once serving, the router drains and then stops it.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    freeze_loaded_objects()
    sender.put(("ready", engine.info))
    asyncio.run(ChildServer(engine, sender).serve(submit_conn, abort_conn))
    sender.close()
    sender.join(10)
    # Skip the interpreter's teardown: torch's thread pools abort ("terminate called ...") when
    # destroyed under the reader threads still blocked on their pipes. Everything is sent.
    sys.stderr.flush()
    # A dead engine (a hung step, a CUDA error, a failed rebuild) exits non-zero: the router sees
    # the pipe close and starts a new process, which is the only way back.
    os._exit(EXIT_ENGINE_DEAD if engine.dead is not None else 0)


class ChildServer:
    def __init__(self, engine: AsyncEngine, sender: Sender) -> None:
        self.engine = engine
        self.sender = sender
        self._live: set[str] = set()  # calls in the engine whose final event is not sent yet
        self._early_aborts: OrderedDict[str, None] = OrderedDict()
        self._steps: list[int] = []
        self._done: asyncio.Event | None = None

    async def serve(self, submit_conn: Connection, abort_conn: Connection) -> None:
        loop = asyncio.get_running_loop()
        self.engine.keep_this_thread_serial()  # this loop's thread: no OpenMP team of its own
        self._done = asyncio.Event()
        self.engine.step_observer = self._steps.append
        self.engine.on_dead = lambda exc: self._done.set()  # every call has its error event
        for conn, handler in ((submit_conn, self._on_submit), (abort_conn, self._on_abort)):
            args = (conn, loop, handler, self._done.set)
            threading.Thread(target=_read, args=args, daemon=True).start()
        reporter = loop.create_task(self._report_stats())
        await self._done.wait()
        reporter.cancel()
        self.engine.abort_all()
        for _ in range(1000):  # each abort ends its call with a final event within a step
            if not self._live:
                break
            await asyncio.sleep(0.01)
        await self.engine.shutdown()

    def _on_submit(self, message: tuple[Any, ...] | None) -> None:
        if message is None:
            self._done.set()
            return
        _, request_id, prompt_ids, params, session_id, priority, output_ids = message
        if request_id in self._early_aborts:
            del self._early_aborts[request_id]
            self.sender.put(("event", _final(request_id, FinishReason.ABORT, None)))
            return
        try:
            self.engine.add_request(
                prompt_ids,
                params,
                sink=self._send,
                request_id=request_id,
                session_id=session_id,
                priority=priority,
                output_ids=output_ids,
            )
        except Exception as exc:  # a duplicate id or a dead engine: the call fails, not the process
            self.sender.put(("event", _final(request_id, FinishReason.ERROR, str(exc))))
            return
        self._live.add(request_id)

    def _send(self, event: TokenEvent) -> None:
        """The engine's sink for every call: straight onto the event pipe. A call ended by
        the engine's death goes as "lost" (the router moves it to another engine; the process
        exits after)."""
        if event.finished:
            self._live.discard(event.request_id)
            if event.finish_reason is FinishReason.ERROR and self.engine.dead is not None:
                self.sender.put(("lost", event.request_id, event.error or "the engine stopped"))
                return
        self.sender.put(("event", event))

    def _on_abort(self, request_id: str | None) -> None:
        if request_id is None:
            return
        if request_id in self._live:
            self.engine.abort(request_id)
            return
        self._early_aborts[request_id] = None  # it overtook its submission on the other pipe
        while len(self._early_aborts) > _MAX_EARLY_ABORTS:
            self._early_aborts.popitem(last=False)

    async def _report_stats(self) -> None:
        while True:
            steps, self._steps = self._steps, []
            self.engine.step_observer = self._steps.append
            self.sender.put(("stats", self.engine.stats(), steps))
            await asyncio.sleep(STATS_INTERVAL)


def _read(
    conn: Connection,
    loop: asyncio.AbstractEventLoop,
    handler: Callable[[Any], None],
    on_eof: Callable[[], None],
) -> None:
    """A reader thread: each message to ``handler`` on the loop; end-of-file (the router died
    or closed the pipe) stops the engine."""
    try:
        while True:
            loop.call_soon_threadsafe(handler, conn.recv())
    except (EOFError, OSError):
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(on_eof)


def _final(request_id: str, reason: FinishReason, error: str | None) -> TokenEvent:
    return TokenEvent(request_id, [], "", reason, error=error)
