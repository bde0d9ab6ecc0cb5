"""A remote engine: another yaied daemon, reached through its public OpenAI API.

Each call is a streaming POST /v1/completions with the prompt as token ids, the output constraint
(if any) as ``structured_outputs``, the session and request ids as ``X-Session-Id`` /
``X-Request-Id``, ``return_token_ids`` for the sampled ids and ``stream_options.include_usage``
for the cached tokens (``usage.prompt_tokens_details``). The stream is read by a task of its
own; aborting cancels that task, which closes the connection, and the remote daemon aborts the
call within one step as for any client that leaves.

Health: a circuit breaker over /health probes and the calls themselves. ``failure_threshold``
failures in a row mark the engine down (its pins are cleared); it is then probed every
``health_check_interval_seconds`` until ``success_threshold`` probes in a row succeed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from yaied.core import sampling_fields
from yaied.core.grammar_spec import request_field
from yaied.core.ids import header_safe
from yaied.core.model_info import ModelInfo
from yaied.core.request import FinishReason, SamplingParams, TokenEvent
from yaied.router.config import EngineEntry, RouterConfig
from yaied.router.handle import CallSink, EngineHandle, EngineUnavailable, Health, Stats
from yaied.router.remote_metrics import stats_from_metrics

log = logging.getLogger(__name__)


@dataclass(slots=True)
class CircuitBreaker:
    """Up until ``failure_threshold`` failures in a row; then down until ``success_threshold``
    successes in a row."""

    failure_threshold: int = 3
    success_threshold: int = 2
    up: bool = True
    failures: int = 0
    successes: int = 0

    def record(self, ok: bool) -> bool | None:
        """Count one outcome; returns the new state when it changed (True: up), else None."""
        if ok:
            self.failures = 0
            self.successes += 1
            if not self.up and self.successes >= self.success_threshold:
                self.up = True
                return True
            return None
        self.successes = 0
        self.failures += 1
        if self.up and self.failures >= self.failure_threshold:
            self.up = False
            return False
        return None


class RemoteHandle(EngineHandle):
    kind = "remote"

    def __init__(
        self,
        engine_id: str,
        entry: EngineEntry,
        router_config: RouterConfig,
        *,
        transport: httpx.AsyncBaseTransport | None = None,  # tests: a mock daemon
    ) -> None:
        super().__init__(engine_id)
        self._transport = transport
        self.url = entry.url.rstrip("/")
        self.api_key = entry.api_key
        self.interval = router_config.health_check_interval_seconds
        self.breaker = CircuitBreaker(
            router_config.failure_threshold, router_config.success_threshold
        )
        self._client: httpx.AsyncClient | None = None
        self._readers: dict[str, asyncio.Task] = {}
        self._stats: Stats | None = None
        self._prober: asyncio.Task | None = None

    async def start(self) -> None:
        """Connect and learn the model's limits; an unreachable daemon starts down and is probed
        (it may come up after the router)."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        timeout = httpx.Timeout(10.0, read=None)  # streams idle between tokens; SSE pings
        self._client = httpx.AsyncClient(
            base_url=self.url, headers=headers, timeout=timeout, transport=self._transport
        )
        up = await self._probe()
        self.health = Health.UP if up else Health.DOWN
        self.breaker.up = up
        if not up:
            log.warning("remote engine %s (%s) does not answer; probing", self.engine_id, self.url)
        self._prober = asyncio.get_running_loop().create_task(self._probe_forever())

    async def _probe(self) -> bool:
        assert self._client is not None
        try:
            if (await self._client.get("/health")).status_code != 200:
                return False
            if self.info is None:
                models = (await self._client.get("/v1/models")).json()["data"]
                self.info = ModelInfo(int(models[0].get("max_model_len", 0)), 0)
            metrics = await self._client.get("/metrics")
            self._stats = stats_from_metrics(metrics.text) if metrics.status_code == 200 else None
            return True
        except (httpx.HTTPError, ValueError, KeyError, IndexError):
            return False

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self._record(await self._probe())

    def _record(self, ok: bool) -> None:
        changed = self.breaker.record(ok)
        if changed is False:
            log.error("remote engine %s (%s) is down", self.engine_id, self.url)
            self.health = Health.DOWN
            self._stats = None
            self._lost()
        elif changed is True:
            log.info("remote engine %s (%s) is back", self.engine_id, self.url)
            self.health = Health.UP

    async def stop(self) -> None:
        if self._prober is not None:
            self._prober.cancel()
        for reader in list(self._readers.values()):
            reader.cancel()
        await asyncio.gather(*self._readers.values(), return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()
        self.health = Health.STOPPED

    def supports(self, params: SamplingParams) -> bool:
        # The OpenAI logprobs format names tokens by text; the router could not map them back.
        return params.logprobs is None and params.prompt_logprobs is None

    def submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        session_id: str | None,
        priority: int,
        sink: CallSink,
    ) -> None:
        if self.health is not Health.UP or self._client is None:
            raise EngineUnavailable(f"remote engine {self.engine_id} is {self.health.value}")
        headers = {"X-Request-Id": header_safe(request_id)}
        if session_id is not None:  # may be any string (the OpenAI `user`): encoded
            headers["X-Session-Id"] = header_safe(session_id)
        body = request_body(prompt_ids, params, priority)
        reader = asyncio.get_running_loop().create_task(
            self._read(request_id, len(prompt_ids), body, headers, sink)
        )
        self._readers[request_id] = reader
        reader.add_done_callback(lambda _: self._readers.pop(request_id, None))

    async def abort(self, request_id: str) -> None:
        reader = self._readers.get(request_id)
        if reader is not None:
            reader.cancel()

    async def _read(
        self,
        request_id: str,
        num_prompt_tokens: int,
        body: dict[str, Any],
        headers: dict[str, str],
        sink: CallSink,
    ) -> None:
        """One call's SSE stream into its sink. Cancelling this task (an abort) closes the
        connection, which aborts the call on the remote daemon."""
        assert self._client is not None
        try:
            async with self._client.stream(
                "POST", "/v1/completions", json=body, headers=headers
            ) as response:
                if response.status_code != 200:
                    refused = await self._refused(request_id, response)
                    if isinstance(refused, EngineUnavailable):
                        sink.lost(str(refused))
                    else:
                        sink.deliver(refused)
                    return
                self._record(True)
                async for event in _sse_events(response, request_id, num_prompt_tokens):
                    sink.deliver(event)
        except asyncio.CancelledError:
            sink.deliver(TokenEvent(request_id, [], "", FinishReason.ABORT))
            raise
        except (httpx.HTTPError, EngineUnavailable) as exc:
            self._record(False)
            sink.lost(f"remote engine {self.engine_id}: {exc!r}")

    async def _refused(
        self, request_id: str, response: httpx.Response
    ) -> TokenEvent | EngineUnavailable:
        """A non-200 answer: the engine's trouble (5xx, 429: try elsewhere) or the call's (4xx)."""
        text = (await response.aread()).decode(errors="replace")
        with contextlib.suppress(ValueError, KeyError, TypeError):
            text = orjson.loads(text)["error"]["message"]
        status = response.status_code
        if status >= 500:
            self._record(False)
        if status >= 500 or status == 429:
            return EngineUnavailable(f"remote engine {self.engine_id}: {status} {text}")
        return TokenEvent(request_id, [], "", FinishReason.ERROR, error=f"{status}: {text}")

    def stats(self) -> Stats | None:
        return self._stats

    def describe(self) -> dict[str, Any]:
        return {"url": self.url}


def request_body(prompt_ids: list[int], params: SamplingParams, priority: int) -> dict[str, Any]:
    """The OpenAI body that asks the remote daemon for exactly these parameters: every sampling
    field the table sends a remote engine, under its completions name, defaults included (the
    remote's model defaults must not replace ours)."""
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
    return body


async def _sse_events(
    response: httpx.Response, request_id: str, num_prompt_tokens: int
) -> AsyncIterator[TokenEvent]:
    """The remote's SSE chunks as TokenEvents. The final event waits for the usage chunk that
    follows it, which carries the cached tokens."""
    final: TokenEvent | None = None
    num_output_tokens = 0
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue  # blank separators and keep-alive comments
        data = line[6:]
        if data == "[DONE]":
            break
        chunk = orjson.loads(data)
        if "error" in chunk:
            message = chunk["error"].get("message", "remote error")
            yield TokenEvent(request_id, [], "", FinishReason.ERROR, error=message)
            return
        for choice in chunk.get("choices", []):
            token_ids = list(choice.get("token_ids") or [])
            num_output_tokens += len(token_ids)
            event = TokenEvent(
                request_id,
                token_ids,
                choice.get("text", ""),
                num_prompt_tokens=num_prompt_tokens,
                num_output_tokens=num_output_tokens,
            )
            if choice.get("finish_reason") is None:
                yield event
                continue
            event.finish_reason = FinishReason(choice["finish_reason"])
            event.stop_reason = choice.get("stop_reason")
            final = event
        usage = chunk.get("usage")
        if usage and final is not None:
            final.num_prompt_tokens = usage.get("prompt_tokens", num_prompt_tokens)
            details = usage.get("prompt_tokens_details") or {}
            final.num_cached_tokens = details.get("cached_tokens", 0)
    if final is None:
        raise EngineUnavailable("the stream ended without a finish reason")
    yield final
