"""A local engine PROCESS: one AsyncEngine per device, spawned, behind three pipes.

    router process                                   engine process (spawned)
    submit sender thread --submit pipe--> reader thread -> loop: engine.add_request(sink)
    abort sender thread  --abort pipe---> reader thread -> loop: engine.abort        |
    reader thread <---------------------------event pipe-------- sender thread <-----+ events,
      -> loop: the call's sink                                                         stats

Aborts travel on their own pipe, so a cancel never waits behind queued submissions. Both sides
write through a thread, so neither event loop blocks on a full pipe. The router closes its copies
of the child's pipe ends, so the child's death reaches the reader thread at once as end-of-file:
every call in flight is told ``sink.lost``, pins are cleared (``on_lost``), and the engine is
restarted after a backoff that doubles while restarts keep failing.

A process that is alive but silent (stopped by SIGSTOP, wedged with the GIL held: its engine's own
step watchdog cannot run) sends no stats, which come every 0.2 s: past
``router.remote_read_timeout_seconds`` of silence, as for a Ray engine, it is killed, and its end
is the path above (its calls move, a new process starts).

``CUDA_VISIBLE_DEVICES`` is set first thing in the child, before torch can initialise CUDA.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from yaied.core.config import EngineConfig
from yaied.core.errors import EngineStartError
from yaied.core.processes import describe_exit
from yaied.core.request import SamplingParams, TokenEvent
from yaied.router.child import ChildSpec, Sender, child_main
from yaied.router.config import EngineEntry, RouterConfig
from yaied.router.handle import CallSink, EngineHandle, EngineUnavailable, Health, Stats

log = logging.getLogger(__name__)
_STABLE_SECONDS = 60.0  # a process that lived this long resets the restart backoff
_REAP_SECONDS = 5.0  # after its pipe closed, how long a dying process gets to be reaped


class LocalProcessHandle(EngineHandle):
    kind = "local"
    resumes = True

    def __init__(
        self,
        engine_id: str,
        entry: EngineEntry,
        engine_config: EngineConfig,
        router_config: RouterConfig,
        num_local_engines: int = 1,
    ) -> None:
        super().__init__(engine_id)
        self.entry = entry
        self.engine_config = engine_config
        self.router_config = router_config
        self.num_local_engines = num_local_engines  # the manager updates it before start()
        self.process: multiprocessing.process.BaseProcess | None = None
        self.num_restarts = 0
        self._sinks: dict[str, CallSink] = {}  # calls in flight in the process, by id
        self._submit: Sender | None = None
        self._aborts: Sender | None = None
        self._stats: Stats | None = None
        self._incarnation = 0  # messages from an older process are ignored
        self._ready: asyncio.Future[None] | None = None
        self._started_at = 0.0
        self._failures = 0  # restarts in a row that failed or died young
        self._stopping = False
        self._restart_task: asyncio.Task | None = None
        self.last_exit: str | None = None  # how the last process ended, in words
        self._last_word = 0.0  # when the process last sent anything (monotonic)
        self._silenced: str | None = None  # why the watchdog killed the process, if it did
        # the process's watchdog, held here: a task nobody references may be collected
        self._watch: asyncio.Task | None = None
        self._exited: asyncio.Event | None = None  # set once the reader reported its end

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    # -- process management -----------------------------------------------------------------

    def child_spec(self) -> ChildSpec:
        """The engine config for the child, and the CUDA devices it may see: its one device,
        or with tensor parallelism its device_ids (else cuda:K..K+N-1 from device = cuda:K),
        renumbered from cuda:0 in the child."""
        device, visible = self.entry.device, None
        size = self.entry.tensor_parallel_size or len(self.entry.device_ids)
        size = size or self.engine_config.engine.tensor_parallel_size
        if device == "auto":
            device = self.engine_config.device.device
        indices = list(self.entry.device_ids)
        if device.startswith("cuda:"):
            first = int(device.split(":", 1)[1])
            indices = list(range(first, first + size))
        if indices:
            parent = os.environ.get("CUDA_VISIBLE_DEVICES")
            ids = [d.strip() for d in parent.split(",")] if parent else None
            visible = ",".join(ids[i] if ids and i < len(ids) else str(i) for i in indices)
            device = "cuda:0"  # the first device the child sees
        threads = self.entry.threads or self.engine_config.device.threads
        threads = threads or default_threads(self.num_local_engines)
        config = dataclasses.replace(
            self.engine_config,
            device=dataclasses.replace(self.engine_config.device, device=device, threads=threads),
            engine=dataclasses.replace(self.engine_config.engine, tensor_parallel_size=size),
        )
        return ChildSpec(self.engine_id, config, visible, threads)

    async def start(self) -> None:
        self._stopping = False
        await self._spawn()

    async def _spawn(self) -> None:
        loop = asyncio.get_running_loop()
        self._incarnation += 1
        self._exited = asyncio.Event()
        self.health = Health.STARTING
        ctx = multiprocessing.get_context("spawn")
        submit_r, submit_w = ctx.Pipe(duplex=False)
        abort_r, abort_w = ctx.Pipe(duplex=False)
        event_r, event_w = ctx.Pipe(duplex=False)
        process = ctx.Process(
            target=child_main,
            args=(self.child_spec(), submit_r, abort_r, event_w),
            name=f"yaied-engine-{self.engine_id}",
            daemon=True,
        )
        starting = loop.create_task(asyncio.to_thread(process.start))
        try:
            await asyncio.shield(starting)
        except asyncio.CancelledError:
            # Cancelled (a removal, the daemon's stop) while the thread starts it: the process
            # starts anyway, and nobody would stop it. End it once started, whatever further
            # cancels come meanwhile (a removal, then the stop).
            while not starting.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(starting)
            for end in (submit_w, abort_w, event_r):
                end.close()
            if starting.exception() is None:
                process.kill()
                await asyncio.to_thread(process.join, _REAP_SECONDS)
            raise
        finally:
            for end in (submit_r, abort_r, event_w):
                end.close()  # only the child holds these now: its death closes the event pipe
        self.process = process
        self._submit = Sender(submit_w, f"yaied-submit-{self.engine_id}")
        self._aborts = Sender(abort_w, f"yaied-abort-{self.engine_id}")
        self._ready = loop.create_future()
        incarnation = self._incarnation
        threading.Thread(
            target=self._read_events,
            args=(event_r, loop, incarnation, process),
            name=f"yaied-events-{self.engine_id}",
            daemon=True,
        ).start()
        await self._ready  # raises when the child failed to load
        self._started_at = self._last_word = time.monotonic()
        self.health = Health.UP
        log.info("engine %s: process %d up", self.engine_id, process.pid)
        self._watch = loop.create_task(self._watch_silence(incarnation, process))

    async def _watch_silence(self, gen: int, process: multiprocessing.process.BaseProcess) -> None:
        """Kill the process once it has been silent past the read timeout while up (the stats
        come every 0.2 s): its end then moves its calls and restarts it, as any death."""
        timeout = self.router_config.remote_read_timeout_seconds
        while gen == self._incarnation and not self._stopping:
            await asyncio.sleep(min(1.0, timeout / 4))
            silent = time.monotonic() - self._last_word
            if gen == self._incarnation and not self._stopping and silent > timeout:
                self._silenced = f"silent for {silent:.0f} s"
                log.error(
                    "engine %s: process %d %s (hung or stopped); killing it",
                    self.engine_id,
                    process.pid,
                    self._silenced,
                )
                process.kill()
                return

    def _read_events(
        self,
        conn: Connection,
        loop: asyncio.AbstractEventLoop,
        gen: int,
        process: multiprocessing.process.BaseProcess,
    ) -> None:
        """The reader thread: every message into the loop; end-of-file means the child died.
        It alone reaps the process: a second waiter would get no exit status."""
        try:
            while True:
                message = conn.recv()
                loop.call_soon_threadsafe(self._on_message, gen, message)
        except (EOFError, OSError):
            pass
        finally:
            conn.close()
            # The pipe closes as the child dies, a moment before it can be reaped: wait for its
            # exit status here (off the loop), so the report says how it ended.
            process.join(_REAP_SECONDS)
            with contextlib.suppress(RuntimeError):  # the loop closed first: nobody to tell
                loop.call_soon_threadsafe(self._on_exit, gen, process.exitcode)

    def _on_message(self, gen: int, message: tuple[Any, ...]) -> None:
        if gen != self._incarnation:
            return
        self._last_word = time.monotonic()
        kind = message[0]
        if kind == "event":
            event: TokenEvent = message[1]
            sink = self._sinks.get(event.request_id)
            if sink is not None:
                if event.finished:
                    del self._sinks[event.request_id]
                sink.deliver(event)
        elif kind == "lost":  # its engine died: the process exits next
            sink = self._sinks.pop(message[1], None)
            if sink is not None:
                sink.lost(f"engine {self.engine_id}: {message[2]}")
        elif kind == "stats":
            self._stats = message[1]
            if self.step_observer is not None:
                for num_tokens in message[2]:
                    self.step_observer(self.engine_id, num_tokens)
        elif kind == "ready":
            self.info = message[1]
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(None)
        elif kind == "failed" and self._ready is not None and not self._ready.done():
            error = ValueError if message[2] else RuntimeError  # see child_main
            self._ready.set_exception(error(f"engine {self.engine_id}: {message[1]}"))

    def _on_exit(self, gen: int, exitcode: int | None) -> None:
        if gen != self._incarnation:
            return
        self._incarnation += 1  # whatever the old process still had in flight is void
        self.last_exit = describe_exit(exitcode)  # "killed by signal 9 (SIGKILL)", ...
        if self._silenced is not None:
            self.last_exit = f"{self.last_exit} after it was {self._silenced}"
            self._silenced = None
        reason = f"engine {self.engine_id} process {self.last_exit}"
        was_up = self.health is Health.UP
        self.health = Health.STOPPED if self._stopping else Health.DOWN
        for sender in (self._submit, self._aborts):
            if sender is not None:
                sender.close()
        lost, self._sinks = self._sinks, {}
        for sink in lost.values():
            sink.lost(reason)
        self._stats = None
        if self._exited is not None:
            self._exited.set()
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(EngineStartError(f"{reason} while loading"))
        if self._stopping:
            return
        log.error("%s; %d calls in flight move to other engines or end", reason, len(lost))
        if was_up:
            self._lost()
            lived = time.monotonic() - self._started_at
            self._failures = 0 if lived >= _STABLE_SECONDS else self._failures + 1
            self._restart_task = asyncio.get_running_loop().create_task(self._restart())

    async def _restart(self) -> None:
        """Respawn until a process comes up, waiting longer after each failure."""
        config = self.router_config
        while not self._stopping:
            delay = config.restart_backoff_seconds * 2 ** max(self._failures - 1, 0)
            delay = min(delay, config.max_restart_backoff_seconds)
            log.info("engine %s: restarting in %.1f s", self.engine_id, delay)
            await asyncio.sleep(delay)
            try:
                await self._spawn()
                self.num_restarts += 1
                return
            except Exception as exc:
                log.error("engine %s: restart failed: %s", self.engine_id, exc)
                self.health = Health.DOWN
                self._failures += 1

    async def stop(self, timeout: float = 15.0) -> None:
        """Ask the process to stop (it aborts what runs and sends the final events) and wait for
        it, up to ``timeout`` less a second kept for killing it. A process still loading (a long
        conversion, say) has nothing to finish: it is killed at once."""
        self._stopping = True
        if self._restart_task is not None:
            self._restart_task.cancel()
        serving = self.health is Health.UP
        for request_id in list(self._sinks):
            await self.abort(request_id)
        if self._submit is not None:
            self._submit.put(None)
        process = self.process
        if process is not None:
            # The reader thread reaps it and reports how it ended (last_exit): wait for that,
            # never join here too.
            if serving:
                await self._exit_reported(max(0.0, timeout - 1.0))
            if not multiprocessing.connection.wait([process.sentinel], 0):  # still running
                log.warning("engine %s: process %d killed", self.engine_id, process.pid)
                process.kill()
                await self._exit_reported(1.0)
        self.health = Health.STOPPED

    async def _exit_reported(self, timeout: float) -> None:
        if self._exited is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._exited.wait(), timeout)

    # -- calls ------------------------------------------------------------------------------

    def submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        session_id: str | None,
        priority: int,
        sink: CallSink,
        output_ids: Sequence[int] = (),
    ) -> None:
        if self.health is not Health.UP or self._submit is None:
            raise EngineUnavailable(f"engine {self.engine_id} is {self.health.value}")
        self._sinks[request_id] = sink
        message = ("submit", request_id, prompt_ids, params, session_id, priority, output_ids)
        self._submit.put(message)

    async def abort(self, request_id: str) -> None:
        if request_id in self._sinks and self._aborts is not None:
            self._aborts.put(request_id)

    def stats(self) -> Stats | None:
        return self._stats

    def describe(self) -> dict[str, Any]:
        return {
            "device": self.entry.device,
            "pid": self.pid,
            "restarts": self.num_restarts,
            "last_exit": self.last_exit,  # None until a process of it ended
            "tensor_parallel_size": self.child_spec().engine_config.engine.tensor_parallel_size,
        }


def default_threads(num_local_engines: int) -> int:
    """CPU threads per local engine: the cores this process may use, shared evenly."""
    return max(1, usable_cores() // max(1, num_local_engines))


def usable_cores() -> int:
    """The cores this process may run on (its affinity, a container's cpuset)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return cores or 1
