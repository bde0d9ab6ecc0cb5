"""The engine task's loop: each step scheduled in the engine task, run in the worker thread
(bounded by engine.step_timeout_s), and finished back in the engine task; with
engine.overlap_steps, the next plain decode step launched while one runs (engine/lookahead.py).

Idle, the loop sleeps until work arrives. The first time a busy spell is followed by
IDLE_TRIM_DELAY_S with no request at all, it hands the heap's freed pages back to the system once
(host_memory.return_freed_memory, glibc's malloc_trim): a burst's freed activations and scratch
stay resident otherwise, and RSS sits at the burst's high-water mark while the daemon idles (the
default model: 40 of the 62 MB a burst of long chats and embeddings added). The trim runs on a
thread of its own, so the event loop and a request arriving meanwhile never wait for it (it took
3.5 ms there; ctypes releases the GIL).

A mixin of `AsyncEngine` (engine/async_engine.py: its interface and state), like `Recovery`
(engine/recovery.py) and `OutputPhase` (engine/output.py), whose `_guarded`, `_die`,
`_fail_step` and `_apply` it calls. `AsyncEngine.step` drives the same `_next_batch` and
`_finish_step` synchronously for tests and the engine fuzzer.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from yaied.core.config import EngineConfig
from yaied.core.request import FinishReason
from yaied.core.step import Batch, StepOutput
from yaied.core.stream import StepSizeSink
from yaied.engine.faults import EngineDeadError, check_invariants
from yaied.engine.grammar import StepMasks
from yaied.engine.lookahead import schedule_ahead

# Seconds with no request, after a busy spell, before the heap is trimmed (see above): long
# enough that a trickle of requests never pays for it, short next to an operator's glance.
IDLE_TRIM_DELAY_S = 1.0

if TYPE_CHECKING:
    from yaied.engine.output import RequestStream
    from yaied.engine.scheduler import Scheduler
    from yaied.worker.worker import Worker


class StepLoop:
    """Uses the engine's state and its `_finish_stream`, `Recovery`'s `_guarded` and `_die`, and
    `_fail_step`, `OutputPhase`'s `_apply`."""

    config: EngineConfig
    scheduler: Scheduler
    worker: Worker
    masks: StepMasks
    overlap_steps: bool
    num_steps: int
    num_steps_ahead: int
    step_observer: StepSizeSink | None
    _executor: ThreadPoolExecutor
    _inbox: deque[RequestStream]
    _aborts: deque[str]
    _wake: asyncio.Event | None
    _task: asyncio.Task | None
    _failed_steps: int
    _rebuilds_in_a_row: int
    _last_progress: float
    _num_queued: int
    _streams: dict[str, RequestStream]
    # Called on a thread of its own once per busy-to-idle spell (tests count its calls).
    idle_trim: Callable[[], None]
    idle_trim_delay_s: float
    _trim_due: bool  # a step ran since the last trim

    def _ensure_started(self) -> None:
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="yaied-engine")

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        with contextlib.suppress(EngineDeadError):  # _die has failed every request already
            while True:
                batch = self._guarded(self._next_batch)
                if batch is None:
                    self._wake.clear()
                    if not self._inbox and not self._aborts:
                        await self._sleep_until_woken()
                    continue
                self._trim_due = True
                if self.overlap_steps:
                    await self._run_overlapped(loop, batch)
                    continue
                output = await self._in_worker(loop, self.worker.execute, batch)
                self._guarded(self._finish_step, batch, output)

    async def _sleep_until_woken(self) -> None:
        """Wait for work; the first wait of an idle spell with no request left trims the heap
        once it has lasted idle_trim_delay_s (see the module's doc)."""
        if self._trim_due and not self._streams:  # a compiling grammar is work that waits
            try:
                await asyncio.wait_for(self._wake.wait(), self.idle_trim_delay_s)
                return
            except TimeoutError:
                self._trim_due = False
                threading.Thread(target=self.idle_trim, name="yaied-trim", daemon=True).start()
        await self._wake.wait()

    async def _run_overlapped(self, loop: asyncio.AbstractEventLoop, batch: Batch) -> None:
        """Steps back to back on the device (engine.overlap_steps): while one runs, the next is
        scheduled on the tokens it is sampling and launched, and only then are the first one's
        tokens applied and sent. Returns with nothing in flight once the scheduler declines to
        schedule ahead (anything but plain decodes, or new work to admit)."""
        pending = await self._in_worker(loop, self.worker.launch, batch)
        while True:
            ahead = None
            if not self._inbox and not self._aborts:  # those go through a step as usual
                ahead = self._guarded(schedule_ahead, self.scheduler, batch)
            output, launched = await self._in_worker(loop, self.worker.advance, ahead, pending)
            self._guarded(self._finish_step, batch, output)
            if launched is None or ahead is None:
                return
            self.num_steps_ahead += 1
            batch, pending = ahead, launched

    async def _in_worker(self, loop: asyncio.AbstractEventLoop, fn: Callable, *args: Any) -> Any:
        """fn(*args) in the worker thread, bounded by engine.step_timeout_s."""
        timeout = self.config.engine.step_timeout_s
        running = loop.run_in_executor(self._executor, fn, *args)
        try:
            return await asyncio.wait_for(running, timeout)
        except TimeoutError:
            # The worker thread is stuck in the device or a kernel; nothing can stop it.
            dead = EngineDeadError(f"a step ran longer than engine.step_timeout_s ({timeout} s)")
            self._die(dead)
            raise dead from None

    def _next_batch(self) -> Batch | None:
        self._drain_inbox()
        self._drain_aborts()
        batch = self.scheduler.schedule()
        if batch is not None:
            self.masks.fill(batch, self.scheduler.requests)
        return batch

    def _finish_step(self, batch: Batch, output: StepOutput) -> None:
        self.num_steps += 1
        self._last_progress = time.monotonic()
        if self.step_observer is not None:
            self.step_observer(batch.num_tokens)
        if output.fatal:
            raise EngineDeadError(f"the device failed: {output.error}")
        if output.error is not None:
            self._fail_step(batch, output.error)
            return
        self._failed_steps = 0
        self.masks.seconds += output.mask_time
        self._apply(batch, output)
        check_invariants(self.scheduler, len(self._streams), self._num_queued)
        self._rebuilds_in_a_row = 0

    def _drain_inbox(self) -> None:
        while self._inbox:
            self.scheduler.add(self._inbox.popleft().request)

    def _drain_aborts(self) -> None:
        while self._aborts:
            self._finish_stream(self._aborts.popleft(), FinishReason.ABORT, error=None)
