"""The engine: one asyncio task that schedules, hands each batch to the worker thread, and streams.

    generate() --inbox--> [engine task: drain inbox/aborts -> schedule -> worker.execute -> update]
                                                                   |
    async for event in generate(...)  <--  per-request queue  <----+ (detokenised TokenEvents)

Only the engine task touches the scheduler, the page pool and the detokenizers, so they need no
locks; only the worker thread touches the model and KV tensors. Closing a stream aborts its request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from yaied.cache.cache_manager import KVCacheManager
from yaied.cache.page_pool import PagePool
from yaied.config import EngineConfig
from yaied.engine.detokenizer import IncrementalDetokenizer
from yaied.engine.scheduler import NONFINITE_TOKEN, Batch, Scheduler, StepOutput
from yaied.engine.validation import InputProcessor
from yaied.request import FinishReason, Request, SamplingParams, TokenEvent, TokenLogprobs
from yaied.worker.worker import Worker, WorkerInfo

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Stream:
    request: Request
    queue: asyncio.Queue[TokenEvent]
    detokenizer: IncrementalDetokenizer | None
    # Prompt logprobs gathered over the prompt's prefill chunks, sent with the first token.
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class AsyncEngine:
    def __init__(self, config: EngineConfig, *, show_progress: bool = True) -> None:
        self.config = config
        # The one worker thread: it builds the worker, so model and KV tensors live with it.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="yaied-worker")
        try:
            self.worker: Worker = self._executor.submit(
                Worker, config, show_progress=show_progress
            ).result()
        except BaseException:
            self._executor.shutdown(wait=False)
            raise
        self.info: WorkerInfo = self.worker.info
        self.inputs = InputProcessor(self.worker.loaded, self.info)
        self.pool = PagePool(self.info.num_pages, self.info.page_size)
        self.kv = KVCacheManager(
            self.pool, enable_prefix_caching=config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(config.scheduler, self.kv, self.info.max_model_len)
        self._streams: dict[str, _Stream] = {}
        self._inbox: deque[_Stream] = deque()
        self._aborts: deque[str] = deque()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self.dead: BaseException | None = None  # set when the loop itself crashed
        self.num_steps = 0
        # Told each step's size in tokens (the server's iteration_tokens histogram). It runs in
        # the engine task, so it must be cheap and must not raise.
        self.step_observer: Callable[[int], None] | None = None

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
        """Stream the events of one request. Bad input raises ValueError before anything is queued;
        closing the iterator (break, cancellation, client gone) aborts the request."""
        params = self.inputs.sampling_params(params, sampling)
        prompt_ids = self.inputs.prompt_token_ids(prompt, params)
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._ensure_started()
        request = Request(
            request_id,
            prompt_ids,
            params,
            session_id=session_id,
            priority=priority,
            eos_token_ids=frozenset() if params.ignore_eos else self.inputs.eos_token_ids,
        )
        stream = _Stream(request, asyncio.Queue(), self.inputs.detokenizer(request))
        self._streams[request_id] = stream
        self._inbox.append(stream)
        self._wake.set()
        finished = False
        try:
            while not finished:
                event = await stream.queue.get()
                finished = event.finished
                yield event
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request by id; a no-op for an unknown or finished one."""
        if request_id in self._streams:
            self._aborts.append(request_id)
            if self._wake is not None:
                self._wake.set()

    @property
    def num_requests_in_flight(self) -> int:
        """Requests whose stream has not ended yet."""
        return len(self._streams)

    def abort_all(self) -> None:
        for request_id in list(self._streams):
            self.abort(request_id)

    def stats(self) -> dict[str, int | float]:
        return {
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting) + len(self._inbox),
            # Cached pages that no running request uses count as free (they are evicted on demand).
            "num_free_pages": self.kv.num_free_pages,
            "num_pages": self.pool.num_pages,
            "num_cached_pages": self.kv.tree.num_cached_pages,
            "prefix_cache_queries": self.kv.num_queried_tokens,
            "prefix_cache_hits": self.kv.num_hit_tokens,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_steps": self.num_steps,
        }

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for request_id in list(self._streams):
            self._finish_stream(request_id, FinishReason.ABORT, error=None)
        self._executor.shutdown(wait=True)

    # -- the loop ---------------------------------------------------------------------------

    def _ensure_started(self) -> None:
        if self.dead is not None:
            raise RuntimeError(f"the engine loop has stopped: {self.dead}")
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="yaied-engine")

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                self._drain_inbox()
                self._drain_aborts()
                batch = self.scheduler.schedule()
                if batch is None:
                    self._wake.clear()
                    if not self._inbox and not self._aborts:
                        await self._wake.wait()
                    continue
                output = await loop.run_in_executor(self._executor, self.worker.execute, batch)
                self.num_steps += 1
                if self.step_observer is not None:
                    self.step_observer(batch.num_tokens)
                self._apply(batch, output)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug in the loop: fail everyone rather than hang them
            log.exception("engine loop crashed")
            self.dead = exc
            for request_id in list(self._streams):
                self._finish_stream(request_id, FinishReason.ERROR, error=f"engine failed: {exc}")
            raise

    def _drain_inbox(self) -> None:
        while self._inbox:
            self.scheduler.add(self._inbox.popleft().request)

    def _drain_aborts(self) -> None:
        while self._aborts:
            self._finish_stream(self._aborts.popleft(), FinishReason.ABORT, error=None)

    def _apply(self, batch: Batch, output: StepOutput) -> None:
        if output.error is not None:
            for seq in batch.seqs:
                self._finish_stream(seq.request_id, FinishReason.ERROR, error=output.error)
            return
        self._fail_nonfinite(batch, output)
        logprobs = self._logprobs_by_request(batch, output)
        for request_id, scored in output.prompt_logprobs.items():
            stream = self._streams.get(request_id)
            if stream is None:
                continue
            # A chunk from position 0 (it leads with None) starts the list anew: after a
            # preemption the prompt is scored again from the start.
            restart = bool(scored) and scored[0] is None
            stream.prompt_logprobs = scored if restart else (stream.prompt_logprobs or []) + scored
        for request in self.scheduler.update(batch, output):
            stream = self._streams[request.request_id]
            token = request.output_token_ids[-1]
            text, stop_string = "", None
            if stream.detokenizer is not None:
                text = stream.detokenizer.push(token)
                stop_string = stream.detokenizer.stop_reason
                if stop_string is not None:
                    self.scheduler.finish(request, FinishReason.STOP)
            reason = request.finish_reason
            stop_reason: str | int | None = stop_string
            if reason is FinishReason.STOP and stop_string is None:
                stop_reason = token if token in request.params.stop_token_ids else None
            if reason is not None and stop_string is None and stream.detokenizer is not None:
                text += stream.detokenizer.flush()
            token_logprobs = logprobs.get(request.request_id)
            prompt_logprobs, stream.prompt_logprobs = stream.prompt_logprobs, None
            self._emit(
                stream,
                [token],
                text,
                reason,
                stop_reason,
                None,
                logprobs=None if token_logprobs is None else [token_logprobs],
                prompt_logprobs=prompt_logprobs,
            )

    def _fail_nonfinite(self, batch: Batch, output: StepOutput) -> None:
        """Fail the requests whose logits were not finite; scheduler.update then skips them."""
        if NONFINITE_TOKEN not in output.sampled_token_ids:
            return
        sampled = (seq for seq in batch.seqs if seq.sample)
        for seq, token in zip(sampled, output.sampled_token_ids, strict=True):
            if token == NONFINITE_TOKEN:
                log.error("request %s: non-finite logits (NaN or inf)", seq.request_id)
                error = "the model produced non-finite logits (NaN or inf)"
                self._finish_stream(seq.request_id, FinishReason.ERROR, error=error)

    @staticmethod
    def _logprobs_by_request(batch: Batch, output: StepOutput) -> dict[str, TokenLogprobs]:
        if output.sampled_logprobs is None:
            return {}
        sampled = [seq.request_id for seq in batch.seqs if seq.sample]
        pairs = zip(sampled, output.sampled_logprobs, strict=True)
        return {request_id: lp for request_id, lp in pairs if lp is not None}

    def _finish_stream(self, request_id: str, reason: FinishReason, error: str | None) -> None:
        """End a request that did not finish by itself (abort, error), freeing its pages."""
        stream = self._streams.get(request_id)
        if stream is None:
            return
        if stream in self._inbox:
            self._inbox.remove(stream)
        elif not stream.request.is_finished:
            self.scheduler.finish(stream.request, reason)
        stream.request.finish_reason = reason
        self._emit(stream, [], "", reason, None, error)

    def _emit(
        self,
        stream: _Stream,
        token_ids: list[int],
        text: str,
        reason: FinishReason | None,
        stop_reason: str | int | None,
        error: str | None,
        *,
        logprobs: list[TokenLogprobs] | None = None,
        prompt_logprobs: list[TokenLogprobs | None] | None = None,
    ) -> None:
        request = stream.request
        stream.queue.put_nowait(
            TokenEvent(
                request.request_id,
                token_ids,
                text,
                reason,
                stop_reason,
                error,
                num_prompt_tokens=request.num_prompt_tokens,
                num_output_tokens=len(request.output_token_ids),
                num_cached_tokens=request.num_cached_tokens,
                queue_time=None
                if request.scheduled_time is None
                else request.scheduled_time - request.arrival_time,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
            )
        )
        if reason is not None:
            del self._streams[request.request_id]  # nothing is ever emitted after the last event
