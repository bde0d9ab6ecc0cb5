"""The engine: one asyncio task that schedules, hands each batch to the worker thread, and streams.

    add_request(ids, params, sink) --inbox--> [engine task: drain inbox/aborts -> schedule
                                               -> worker.execute -> update -> detokenize]
    sink(event)  <-----------------------------------------------+ (one call per TokenEvent)

The caller provides the sink (yaied/core/stream.py): the router's, the offline generate()'s or a
test's, so an event crosses one queue, the reader's, on its way out.

Only the engine task touches the scheduler, the page pool and the detokenizers, so they need no
locks; only the worker thread touches the model and KV tensors. Aborting a request ends it with
a final event within one step.
Faults follow one escalation order (yaied/engine/faults.py): a request, then the bookkeeping
(rebuilt in-process), then the engine itself (EngineDeadError: its process must restart).
Tests and the engine fuzzer drive the same code synchronously through add_request() and step().

Structured outputs (engine/grammar.py): a constrained request gets its matcher at add_request
from the compile cache, where its caller's compile put it. An engine in another process compiles
again in its own cache: such a request waits, off the queue, until a compile task finishes, then
enters the inbox (or fails alone if the spec does not compile). Each step fills the rows of the
persistent token bitmask just before the batch goes to the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from yaied.cache.cache_manager import KVCacheManager
from yaied.cache.page_pool import PagePool
from yaied.core.config import EngineConfig
from yaied.core.metric_names import restarts_key
from yaied.core.model_info import ModelInfo
from yaied.core.request import FinishReason, SamplingParams, TokenEvent
from yaied.core.step import Batch, StepOutput
from yaied.core.stream import EventSink, EventStream, StepSizeSink
from yaied.engine.faults import RESTART_REASONS, EngineDeadError
from yaied.engine.grammar import StepMasks
from yaied.engine.inputs import InputProcessor
from yaied.engine.lookahead import overlaps
from yaied.engine.output import OutputPhase, RequestStream
from yaied.engine.recovery import Recovery
from yaied.engine.scheduler import Scheduler
from yaied.engine.step_loop import IDLE_TRIM_DELAY_S, StepLoop
from yaied.engine.threads import run_torch_serially
from yaied.worker.host_memory import return_freed_memory
from yaied.worker.parallel.leader import RankLauncher
from yaied.worker.worker import Worker

log = logging.getLogger(__name__)


class AsyncEngine(StepLoop, Recovery, OutputPhase):
    def __init__(
        self,
        config: EngineConfig,
        *,
        show_progress: bool = True,
        rank_launcher: RankLauncher | None = None,  # tensor-parallel ranks started elsewhere
    ) -> None:
        self.config = config
        # The one worker thread: it builds the worker, so model and KV tensors live with it.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="yaied-worker")
        try:
            self.worker: Worker = self._executor.submit(
                Worker, config, show_progress=show_progress, rank_launcher=rank_launcher
            ).result()
        except BaseException:
            self._executor.shutdown(wait=False)
            raise
        self._worker_thread = self._executor.submit(threading.current_thread).result()
        self.info: ModelInfo = self.worker.info
        loaded = self.worker.loaded
        self.inputs = InputProcessor(loaded.folder, loaded.hf_config, self.info)
        self.masks = StepMasks(
            config.scheduler.max_num_seqs, self.info.vocab_size, self.worker.device
        )
        self._new_bookkeeping()
        self.overlap_steps = overlaps(config, self.worker)
        self._streams: dict[str, RequestStream] = {}
        self._inbox: deque[RequestStream] = deque()
        self._aborts: deque[str] = deque()
        # Constrained requests whose grammar is compiling: in _streams, not yet in the inbox.
        self._compiling: dict[str, asyncio.Task] = {}
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self.dead: BaseException | None = None  # set when the engine stopped for good
        # Told once, with the reason, when the engine stops for good (level 3 of faults.py).
        self.on_dead: Callable[[BaseException], None] | None = None
        self.num_steps = 0
        self.num_steps_ahead = 0
        self.restarts = dict.fromkeys(RESTART_REASONS, 0)  # in-process rebuilds, by reason
        self._failed_steps = 0  # whole steps failed in a row
        self._rebuilds_in_a_row = 0  # rebuilds with no good step between them
        self._last_progress = time.monotonic()  # the last finished step, or when work arrived
        # Told each step's size in tokens (the server's iteration_tokens histogram). It runs in
        # the engine task, so it must be cheap and must not raise.
        self.step_observer: StepSizeSink | None = None
        self.idle_trim = return_freed_memory  # once a busy spell has gone idle (step_loop.py)
        self.idle_trim_delay_s = IDLE_TRIM_DELAY_S
        self._trim_due = False

    def _new_bookkeeping(self) -> None:
        """A fresh page pool, prefix cache and scheduler: at start, and to recover (level 2)."""
        self.pool = PagePool(self.info.num_pages, self.info.page_size)
        self.cache = KVCacheManager(
            self.pool, enable_prefix_caching=self.config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler.for_engine(self.config, self.cache, self.info.max_model_len)

    @property
    def tokenizer(self):
        return self.inputs.tokenizer

    # -- public API -------------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        session_id: str | None = None,
        priority: int = 0,
        **sampling: object,
    ) -> AsyncIterator[TokenEvent]:
        """Stream the events of one request (the offline API's path). Bad input raises
        ValueError before anything is queued; closing the iterator (break, cancellation, client
        gone) aborts the request."""
        params = self.inputs.sampling_params(params, sampling)
        prompt_ids = self.inputs.prompt_token_ids(prompt, params)
        if params.structured is not None:  # a bad spec raises here, before anything is queued
            await self.inputs.grammars.compile(params.structured)
        request_id = request_id or uuid.uuid4().hex
        events: EventStream[None] = EventStream(on_close=lambda: self.abort(request_id))
        self.add_request(
            prompt_ids,
            params,
            sink=events.sink(None),
            request_id=request_id,
            session_id=session_id,
            priority=priority,
        )
        async with contextlib.aclosing(events.events()) as stream:
            async for _, event in stream:
                yield event

    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        sink: EventSink,
        request_id: str | None = None,
        session_id: str | None = None,
        priority: int = 0,
        output_ids: Sequence[int] = (),
    ) -> str:
        """Queue a request whose prompt and parameters have been through ``self.inputs`` (the
        router's front end or generate() did that: the engine does not check them again). Its
        events go to ``sink``, on the event loop, the last with a finish reason. Returns its id.
        Starts the loop task when called from a running event loop; tests that step the engine
        themselves (step()) call it from plain code.

        ``output_ids``: a call moved here from another engine, with these tokens already sent
        to its client. It resumes as a preempted request does (prompt plus output recomputed),
        with its sampling state rebuilt from them: the seeded draws' position, the penalties'
        counts, max_tokens and min_tokens count them, and its detokenizer (held-back text, stop
        strings) and grammar replay them. Its events carry only the tokens after them.

        A constrained request whose grammar is not in the compile cache waits for its compile
        (in the loop), or compiles here (from plain code, where a bad spec raises)."""
        if self.dead is not None:
            raise RuntimeError(f"the engine has stopped: {self.dead}")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = self.inputs.new_request(
            request_id, prompt_ids, params, session_id=session_id, priority=priority,
            output_ids=output_ids, compile_now=not _in_event_loop(),
        )  # fmt: skip
        spec = params.structured
        stream = RequestStream(request, sink, self.inputs.detokenizer(request))
        stream.replay_sent()
        if not self._streams:
            self._last_progress = time.monotonic()  # idle until now: nothing was stalled
        self._streams[request_id] = stream
        if (error := stream.replay_grammar()) is not None:  # the moved output left its grammar
            self._end_stream(stream, FinishReason.ERROR, error)
        elif spec is not None and request.grammar is None:
            task = asyncio.get_running_loop().create_task(self._compile_then_queue(stream))
            self._compiling[request_id] = task
        else:
            self._inbox.append(stream)
        if _in_event_loop():
            self._ensure_started()
            self._wake.set()
        return request_id

    async def _compile_then_queue(self, stream: RequestStream) -> None:
        """Compile a request's grammar in this process's cache, then queue it; a spec that does
        not compile fails that request alone. An abort meanwhile cancels this task."""
        request = stream.request
        assert request.params.structured is not None
        grammars = self.inputs.grammars
        try:
            compiled = await grammars.compile(request.params.structured)
        except Exception as exc:  # StructuredOutputError: invalid, or past the compile timeout
            if self._compiling.pop(request.request_id, None) is not None:
                self._end_stream(stream, FinishReason.ERROR, str(exc))
            return
        if self._compiling.pop(request.request_id, None) is None:
            return  # ended meanwhile (the engine stopped)
        request.grammar = grammars.matcher_of(compiled)
        if (error := stream.replay_grammar()) is not None:  # a call moved here mid-output
            self._compiling.pop(request.request_id, None)
            self._end_stream(stream, FinishReason.ERROR, error)
            return
        self._inbox.append(stream)
        self._ensure_started()
        self._wake.set()

    def step(self) -> bool:
        """Run one step in the calling thread: schedule, execute, update, with the same fault
        handling as the loop (no step timeout). For tests and the engine fuzzer, which drive
        the engine synchronously; never while the loop task runs. False when there was no work.
        Raises EngineDeadError once the engine has stopped."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine has stopped: {self.dead}")
        batch = self._guarded(self._next_batch)
        if batch is None:
            return False
        self._guarded(self._finish_step, batch, self._execute_here(batch))
        return True

    def _execute_here(self, batch: Batch) -> StepOutput:
        """worker.execute in the worker thread, where the worker set torch's thread count: run
        from another thread, the model would use torch's default threads (on a busy two-core
        machine, steps 50-100x slower)."""
        if threading.current_thread() is self._worker_thread:
            return self.worker.execute(batch)
        return self._executor.submit(self.worker.execute, batch).result()

    def abort(self, request_id: str) -> None:
        """Abort a request by id; a no-op for an unknown or finished one."""
        if request_id in self._streams:
            self._aborts.append(request_id)
            if self._wake is not None:
                self._wake.set()

    @property
    def _num_queued(self) -> int:
        """Requests not handed to the scheduler yet: in the inbox, or compiling their grammar."""
        return len(self._inbox) + len(self._compiling)

    @property
    def num_requests_in_flight(self) -> int:
        """Requests whose stream has not ended yet."""
        return len(self._streams)

    def abort_all(self) -> None:
        for request_id in list(self._streams):
            self.abort(request_id)

    def stats(self) -> dict[str, int | float]:
        stats: dict[str, int | float] = {
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting) + self._num_queued,
            # Cached pages that no running request uses count as free (they are evicted on demand).
            "num_free_pages": self.cache.num_free_pages,
            "num_pages": self.pool.num_pages,
            "num_cached_pages": self.cache.tree.num_cached_pages,
            "prefix_cache_queries": self.cache.num_queried_tokens,
            "prefix_cache_hits": self.cache.num_hit_tokens,
            **self.scheduler.counters(),  # preemptions, speculative drafts
            "num_steps": self.num_steps,
            "num_steps_ahead": self.num_steps_ahead,  # of those, launched before the last ended
            # Filling and applying grammar masks, over the steps that had a constrained row.
            "structured_output_mask_seconds": self.masks.seconds,
            "structured_output_masked_steps": self.masks.steps,
        }
        for reason, count in self.restarts.items():
            stats[restarts_key(reason)] = count
        return stats

    async def shutdown(self) -> None:
        task, self._task = self._task, None
        while task is not None and not task.done():
            # Again until it ends: on Python 3.11 a cancel that lands as a step finishes is
            # swallowed by asyncio.wait_for (_in_worker), and the loop would wait for work forever
            # (an engine removed while it runs calls).
            task.cancel()
            await asyncio.wait({task}, timeout=0.05)
        if task is not None and not task.cancelled() and (exc := task.exception()) is not None:
            log.error("the engine loop ended with %r", exc)
        for request_id in list(self._streams):
            self._finish_stream(request_id, FinishReason.ABORT, error=None)
        self._executor.shutdown(wait=self.dead is None)  # a dead engine's may hang: no wait
        self.worker.close()  # tensor-parallel ranks go after the last step (a stuck one raises)

    def keep_this_thread_serial(self) -> None:
        """Torch ops issued from the calling thread (a host's own event loop: the daemon's, an
        engine process's) run on it alone, so that the worker thread holds the process's only
        OpenMP team (engine/threads.py). The offline LLM leaves its caller's thread alone."""
        run_torch_serially()

    def _finish_stream(self, request_id: str, reason: FinishReason, error: str | None) -> None:
        """End a request that did not finish by itself (abort, error), freeing its pages."""
        stream = self._streams.get(request_id)
        if stream is None:
            return
        compiling = self._compiling.pop(request_id, None)
        if compiling is not None:
            compiling.cancel()  # its compile goes on for the cache unless nobody else waits
        elif stream in self._inbox:
            self._inbox.remove(stream)
        elif not stream.request.is_finished:
            self.scheduler.finish(stream.request, reason)
        self._end_stream(stream, reason, error)


def _in_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
