"""What goes over the wire to a remote engine: the request's body and headers, and the SSE
stream that comes back, read into TokenEvents; and the bodies of its other answers, read within a
bound.

The stream is checked as it is read: a chunk that is not what a yaied daemon sends (not JSON,
not an object, ids that are not integers, a finish reason we do not know) raises
RemoteStreamError, which the handle counts against the remote, never leaving the call waiting.
A line is read up to MAX_LINE_BYTES, far above any event a daemon sends; a longer one (a line
that never ends) raises LineTooLong, and the handle marks the remote down at once. A whole body
(a probe's answer, an error) is read up to the bound its caller gives: past it, BodyTooLarge.
Both are Oversized, and both hold no more than their bound and one chunk (core/bounded.py), on
what a compressed body expands to: the handle asks for identity, and decompresses in pieces a
body sent compressed anyway.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from yaied.core import sampling_fields
from yaied.core.bounded import BadEncoding, BodyBuffer, Decoder, LineSplitter, TooLong
from yaied.core.grammar_spec import request_field
from yaied.core.request import FinishReason, SamplingParams, TokenEvent
from yaied.router.handle import EngineUnavailable

# What a daemon's server puts before its engine's words when a call fails (server/generate.py);
# the router's own server puts it there again, so it is taken off what a remote sends.
_FAILED_PREFIX = "generation failed: "
# A line of the stream: an event of one step's tokens is well under a kilobyte; an error
# message, a few. A remote that sends more without a newline is not a yaied daemon.
MAX_LINE_BYTES = 1 << 20


class RemoteStreamError(Exception):
    """The remote answered with something that is not a yaied completion stream."""


class Oversized(RemoteStreamError):
    """A line or a body past its bound: no yaied daemon sends one."""


class LineTooLong(Oversized):
    """A line of the stream past MAX_LINE_BYTES with no end in sight."""


class BodyTooLarge(Oversized):
    """A body past the bound its reader gave."""


def request_body(
    prompt_ids: list[int],
    params: SamplingParams,
    priority: int,
    output_ids: Sequence[int] = (),
) -> dict[str, Any]:
    """The OpenAI body that asks the remote daemon for exactly these parameters: every sampling
    field the table sends a remote engine, under its completions name, defaults included (the
    remote's model defaults must not replace ours). ``output_ids``: a moved call's tokens sent
    already, as yaied's ``resume_token_ids`` (the remote resumes after them)."""
    body: dict[str, Any] = {
        "prompt": prompt_ids,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
        "priority": priority,
    }
    for spec in sampling_fields.FIELDS:
        if spec.remote:
            body[spec.names("completion")[0]] = spec.to_json(getattr(params, spec.name))
    if params.structured is not None:  # the remote daemon compiles it again, in its own cache
        body["structured_outputs"] = request_field(params.structured)
    if output_ids:
        body["resume_token_ids"] = list(output_ids)
    return body


async def sse_events(
    response: httpx.Response, request_id: str, num_prompt_tokens: int, num_sent: int = 0
) -> AsyncIterator[TokenEvent]:
    """The remote's SSE chunks as TokenEvents. The final event waits for the usage chunk that
    follows it, which carries the cached tokens. A chunk that is not what a yaied daemon sends
    raises RemoteStreamError. ``num_sent``: output tokens of a resumed call sent before."""
    stream = _StreamState(request_id, num_prompt_tokens, num_sent)
    async for line in _lines(response):
        if not line.startswith("data: "):
            continue  # blank separators and keep-alive comments
        data = line[6:]
        if data == "[DONE]":
            break
        try:
            events = stream.read(orjson.loads(data))
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise RemoteStreamError(f"unreadable chunk {data[:200]!r}: {exc}") from None
        for event in events:
            yield event
        if stream.failed:
            return
    if stream.final is None:
        raise EngineUnavailable("the stream ended without a finish reason")
    yield stream.final


async def _chunks(response: httpx.Response) -> AsyncIterator[bytes]:
    """The body, decompressed in pieces of at most PIECE_BYTES (core/bounded.py's Decoder: a
    bound holds on what a compressed body expands to); an encoding it does not read, or a body
    not valid in its own, raises RemoteStreamError. A response built whole (a mock transport's)
    was read and decoded when it was made: its content is all there is."""
    if response.is_stream_consumed:
        yield response.content
        return
    try:
        decoder = Decoder(response.headers.get("content-encoding"))
        async for raw in response.aiter_raw():
            for piece in decoder.feed(raw):
                yield piece
    except BadEncoding as exc:
        raise RemoteStreamError(str(exc)) from None


async def _lines(response: httpx.Response) -> AsyncIterator[str]:
    """The body's lines (core/bounded.py's LineSplitter), each of at most MAX_LINE_BYTES: past
    that, LineTooLong, having held no more than that and one chunk."""
    lines = LineSplitter(MAX_LINE_BYTES)
    try:
        async for chunk in _chunks(response):
            for line in lines.feed(chunk):
                yield line
        for line in lines.end():
            yield line
    except TooLong as exc:
        raise LineTooLong(str(exc)) from None


async def read_body(response: httpx.Response, limit: int, what: str) -> bytes:
    """``response``'s body, of at most ``limit`` bytes: past that, BodyTooLarge (``what``, say
    "a /metrics body", names it), having held no more than that and one chunk."""
    body = BodyBuffer(limit)
    try:
        async for chunk in _chunks(response):
            body.feed(chunk)
    except TooLong:
        raise BodyTooLarge(f"{what} of over {limit} bytes") from None
    return body.value()


@dataclass(slots=True)
class _StreamState:
    request_id: str
    num_prompt_tokens: int
    num_output_tokens: int = 0
    final: TokenEvent | None = None  # held until the usage chunk after it
    failed: bool = False

    def read(self, chunk: dict[str, Any]) -> list[TokenEvent]:
        """One chunk's events; raises (ValueError, TypeError, ...) on anything malformed."""
        if not isinstance(chunk, dict):
            raise TypeError("a chunk must be a JSON object")
        if "error" in chunk:
            error = chunk["error"]
            message = error.get("message") if isinstance(error, dict) else None
            message = str(message or error)
            while message.startswith(_FAILED_PREFIX):  # older daemons in a chain: every copy
                message = message[len(_FAILED_PREFIX) :]
            self.failed = True
            return [self._event([], "", FinishReason.ERROR, error=message)]
        events = []
        for choice in chunk.get("choices") or []:
            token_ids = list(choice.get("token_ids") or [])
            text = choice.get("text", "")
            if not all(type(t) is int for t in token_ids) or not isinstance(text, str):
                raise TypeError("token_ids must be integers and text a string")
            self.num_output_tokens += len(token_ids)
            reason = choice.get("finish_reason")
            if reason is None:
                events.append(self._event(token_ids, text, None))
                continue
            # An unknown reason raises ValueError: the remote speaks another protocol.
            self.final = self._event(token_ids, text, FinishReason(reason))
            self.final.stop_reason = choice.get("stop_reason")
        usage = chunk.get("usage")
        if usage and self.final is not None:
            self.final.num_prompt_tokens = int(usage.get("prompt_tokens", self.num_prompt_tokens))
            details = usage.get("prompt_tokens_details") or {}
            self.final.num_cached_tokens = int(details.get("cached_tokens", 0))
        return events

    def _event(
        self,
        token_ids: list[int],
        text: str,
        reason: FinishReason | None,
        error: str | None = None,
    ) -> TokenEvent:
        return TokenEvent(
            self.request_id,
            token_ids,
            text,
            reason,
            error=error,
            num_prompt_tokens=self.num_prompt_tokens,
            num_output_tokens=self.num_output_tokens,
        )
