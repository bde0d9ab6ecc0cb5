"""The output phase of a step: one request's new token turned into the event its sink gets.

A RequestStream is one request in flight: the engine's Request, the caller's sink, and what the
output phase keeps between steps (the detokenizer with its held-back text, the prompt logprobs
gathered over prefill chunks). Only the engine task calls into it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from yaied.core.detokenizer import IncrementalDetokenizer
from yaied.core.request import FinishReason, Request, TokenEvent, TokenLogprobs
from yaied.core.step import Batch, StepOutput
from yaied.core.stream import EventSink

if TYPE_CHECKING:
    from yaied.engine.scheduler import Scheduler

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class RequestStream:
    """One request in flight and the sink its events go to."""

    request: Request
    sink: EventSink
    detokenizer: IncrementalDetokenizer | None
    # Prompt logprobs gathered over the prompt's prefill chunks, sent with the first token.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_emitted: int = 0  # output tokens sent so far (a speculative step may add several)
    pooled: list[float] | None = None  # params.pooling: the sum so far ("mean") or last row

    def replay_sent(self) -> None:
        """A request that starts with output (a call moved from another engine, whose client
        has those tokens): its detokenizer takes them again, so it holds back what the first
        engine held back and matches stop strings across the seam; its events start after them.
        The text this replay decides was sent already and is dropped."""
        output = self.request.output_token_ids
        if self.detokenizer is not None:
            for token in output:
                if self.detokenizer.finished:  # a stop string ended it: it never moves
                    break
                self.detokenizer.push(token)
        self.num_emitted = len(output)

    def replay_grammar(self) -> str | None:
        """Advance a moved request's grammar through the output it starts with (the matcher has
        then accepted exactly output_token_ids, as after a preemption). The error if it refuses
        one: that output never came from this grammar."""
        grammar = self.request.grammar
        for token in self.request.output_token_ids if grammar is not None else ():
            if not grammar.accept(token):
                return grammar.error or f"the sent output does not match its grammar at {token}"
        return None

    def add_pooled(self, vector: list[float], restart: bool) -> None:
        # A chunk from position 0 starts the sum anew: after a preemption the prompt is run
        # again from the start (pooling requests never match the prefix cache for "mean").
        if restart or self.pooled is None or self.request.params.pooling == "last":
            self.pooled = list(vector)
        else:
            self.pooled = [a + b for a, b in zip(self.pooled, vector, strict=True)]

    def embedding(self) -> list[float] | None:
        if self.pooled is None or self.request.params.pooling != "mean":
            return self.pooled
        n = self.request.num_prompt_tokens
        return [value / n for value in self.pooled]

    def add_prompt_logprobs(self, scored: list[TokenLogprobs | None]) -> None:
        # A chunk from position 0 (it leads with None) starts the list anew: after a
        # preemption the prompt is scored again from the start.
        restart = bool(scored) and scored[0] is None
        self.prompt_logprobs = scored if restart else (self.prompt_logprobs or []) + scored

    def token_event(
        self,
        token_logprobs: list[TokenLogprobs] | None,
        finish_on_stop_string: Callable[[int], None],
    ) -> TokenEvent:
        """The event for the request's new tokens (one, or several after a speculative step):
        their text (stop strings held back until decided), the finish reason, logprobs, and the
        prompt's logprobs with the first token. A stop string completed by one of them calls
        ``finish_on_stop_string`` (the scheduler's) with how many tokens after it to drop."""
        request = self.request
        tokens = request.output_token_ids[self.num_emitted :]
        text, stop_string = "", None
        if self.detokenizer is not None:
            for i, new in enumerate(tokens):
                text += self.detokenizer.push(new)
                stop_string = self.detokenizer.stop_reason
                if stop_string is not None:
                    finish_on_stop_string(len(tokens) - i - 1)
                    tokens = tokens[: i + 1]
                    # The stop string may end on the last token max_tokens allows: the request
                    # is then finished already (as LENGTH), but it stopped on the string.
                    request.finish_reason = FinishReason.STOP
                    break
        self.num_emitted += len(tokens)
        token = tokens[-1]
        reason = request.finish_reason
        stop_reason: str | int | None = stop_string
        if reason is FinishReason.STOP and stop_string is None:
            stop_reason = token if token in request.stop_ids else None
        if reason is not None and stop_string is None and self.detokenizer is not None:
            text += self.detokenizer.flush()
        prompt_logprobs, self.prompt_logprobs = self.prompt_logprobs, None
        return self.event(
            tokens,
            text,
            reason,
            stop_reason,
            None,
            logprobs=None if token_logprobs is None else token_logprobs[: len(tokens)],
            prompt_logprobs=prompt_logprobs,
        )

    def event(
        self,
        token_ids: list[int],
        text: str,
        reason: FinishReason | None,
        stop_reason: str | int | None,
        error: str | None,
        *,
        logprobs: list[TokenLogprobs] | None = None,
        prompt_logprobs: list[TokenLogprobs | None] | None = None,
    ) -> TokenEvent:
        request = self.request
        queued = request.scheduled_time
        return TokenEvent(
            request.request_id,
            token_ids,
            text,
            reason,
            stop_reason,
            error,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=len(request.output_token_ids),
            num_cached_tokens=request.num_cached_tokens,
            queue_time=None if queued is None else queued - request.arrival_time,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )


def logprobs_by_request(batch: Batch, output: StepOutput) -> dict[str, list[TokenLogprobs]]:
    """The new tokens' logprobs (accepted drafts first, then the sampled token), by request id,
    for the rows that asked for them."""
    if output.sampled_logprobs is None:
        return {}
    sampled = [seq.request_id for seq in batch.seqs if seq.sample]
    pairs = zip(sampled, output.sampled_logprobs, strict=True)
    drafts = output.draft_logprobs
    return {rid: [*drafts.get(rid, ()), lp] for rid, lp in pairs if lp is not None}


class OutputPhase:
    """The engine's output phase, a mixin of `AsyncEngine` run in its task: a finished step's
    results to events, one request at a time. Level 1 of the fault escalation lives here: an
    exception in one request's handling ends that request alone. Uses the engine's scheduler,
    streams and its `_finish_stream`."""

    scheduler: Scheduler
    _streams: dict[str, RequestStream]

    def _apply(self, batch: Batch, output: StepOutput) -> None:
        # Failed rows first: the scheduler then skips them, so their pages are never cached.
        for request_id, error in output.failed.items():
            log.error("request %s failed: %s", request_id, error)
            self._finish_stream(request_id, FinishReason.ERROR, error=error)
        logprobs = logprobs_by_request(batch, output)
        for request_id, scored in output.prompt_logprobs.items():
            self._for_request(request_id, self._gather_prompt_logprobs, request_id, scored)
        if output.pooled:
            starts = {seq.request_id: seq.start_pos for seq in batch.seqs}
            for request_id, vector in output.pooled.items():
                restart = starts[request_id] == 0
                self._for_request(request_id, self._gather_pooled, request_id, vector, restart)
        for request in self.scheduler.update(batch, output):
            token_logprobs = logprobs.get(request.request_id)
            self._for_request(request.request_id, self._emit_token, request, token_logprobs)

    def _for_request(self, request_id: str, fn: Callable[..., None], *args: Any) -> None:
        """Level 1: an exception in one request's own handling ends that request alone."""
        try:
            fn(*args)
        except Exception as exc:
            log.exception("request %s failed while handling its output", request_id)
            error = f"internal error while handling the request: {type(exc).__name__}: {exc}"
            self._finish_stream(request_id, FinishReason.ERROR, error=error)

    def _gather_prompt_logprobs(self, request_id: str, scored: list[TokenLogprobs | None]) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.add_prompt_logprobs(scored)

    def _gather_pooled(self, request_id: str, vector: list[float], restart: bool) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.add_pooled(vector, restart)

    def _emit_token(self, request: Request, token_logprobs: list[TokenLogprobs] | None) -> None:
        stream = self._streams[request.request_id]
        if request.finish_reason is FinishReason.ERROR:  # its grammar refused the token
            error = request.grammar.error if request.grammar is not None else None
            log.error("request %s failed: %s", request.request_id, error)
            self._end_stream(stream, FinishReason.ERROR, error or "the output left its grammar")
            return
        finish = lambda drop: self.scheduler.finish(request, FinishReason.STOP, drop)  # noqa: E731
        event = stream.token_event(token_logprobs, finish)
        if request.params.pooling is not None:  # an embedding: the vector, not the token
            event.embedding, event.token_ids = stream.embedding(), []
        self._send(stream, event)

    def _end_stream(self, stream: RequestStream, reason: FinishReason, error: str | None) -> None:
        """The stream's final event, without touching the scheduler (after a rebuild, or when
        the engine stopped, its old state is gone or cannot be trusted)."""
        stream.request.finish_reason = reason
        self._send(stream, stream.event([], "", reason, None, error))

    def _send(self, stream: RequestStream, event: TokenEvent) -> None:
        if event.finished:
            del self._streams[event.request_id]  # nothing is ever emitted after the last event
        stream.sink(event)
