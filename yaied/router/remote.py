"""A remote engine: another yaied daemon, reached through its public OpenAI API.

Each call is a streaming POST /v1/completions with the prompt as token ids, the output constraint
(if any) as ``structured_outputs``, the session and request ids as ``X-Session-Id`` /
``X-Request-Id``, ``return_token_ids`` for the sampled ids and ``stream_options.include_usage``
for the cached tokens (``usage.prompt_tokens_details``). The stream is read by a task of its
own; aborting cancels that task, which closes the connection, and the remote daemon aborts the
call within one step as for any client that leaves. A call moved here from another engine
carries the tokens its caller has as ``resume_token_ids`` (yaied's own field): the remote
resumes after them, as an engine of its own would.

Health: a circuit breaker over /health probes and the calls themselves. ``failure_threshold``
failures in a row mark the engine down (its pins are cleared); it is then probed every
``health_check_interval_seconds`` until ``success_threshold`` probes in a row succeed. Each
probe reads the remote's context length again (/v1/models): it is sent only calls it holds.
Each answer is read up to MAX_PROBE_BYTES: one past it fails the probe, saying why once.

Whatever goes wrong in a call's reader ends that call, and only the engine's faults count against
the engine:

- the engine's fault (it cannot be reached, it stopped talking for ``remote_read_timeout_seconds``,
  it answered 5xx or something that is not our stream): a failure, and ``sink.lost``, so the
  call moves to another engine; a line past remote_stream.MAX_LINE_BYTES, or an error body past
  MAX_ERROR_BYTES, marks it down at once;
- the call's own (a header or body httpx refuses to send, a 4xx, a bug here): an error event;
- waiting for one of the ``remote_max_connections`` connections is back-pressure: calls queue
  there as they would in the remote's own queue. Probes use a client of their own, so a pool full
  of streams never fails one.

Loops (core/forwarding.py): a remote whose /health answers with this daemon's own instance id is
this daemon; it is refused (down for good, saying why, never probed again). Each call carries the
daemons it came through plus this one (X-Yaied-Via); a daemon it came back to answers 508
``forwarding_loop``, which moves the call elsewhere without counting against the remote.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from yaied.core.bounded import ACCEPT_IDENTITY
from yaied.core.forwarding import INSTANCE_HEADER, LOOP_CODE, VIA_HEADER
from yaied.core.ids import header_safe
from yaied.core.model_info import ModelInfo
from yaied.core.request import FinishReason, SamplingParams, TokenEvent
from yaied.router.config import EngineEntry, RouterConfig
from yaied.router.handle import CallSink, EngineHandle, EngineUnavailable, Health, Stats
from yaied.router.remote_metrics import stats_from_metrics
from yaied.router.remote_stream import (
    Oversized,
    RemoteStreamError,
    read_body,
    request_body,
    sse_events,
)

log = logging.getLogger(__name__)
_PROBE_TIMEOUT = httpx.Timeout(10.0)
_CONNECT_TIMEOUT = 10.0  # also for writing a request body
# The longest context a remote may report: above any model's (a few million tokens at most).
MAX_CONTEXT_TOKENS = 1 << 24
# The most read of a probe's answer (/health, /v1/models, /metrics; a router's /metrics over
# many engines is tens of kilobytes) and of an error's body (a message, a few hundred bytes).
MAX_PROBE_BYTES = 8 << 20
MAX_ERROR_BYTES = 256 << 10


# What says the remote engine is at fault, not the call: it cannot be reached, stopped talking
# (a read timeout), broke the HTTP protocol, or sent a stream we cannot read.
_ENGINE_FAULTS = (
    httpx.ConnectTimeout,
    httpx.ReadTimeout,
    httpx.WriteTimeout,
    httpx.NetworkError,
    httpx.RemoteProtocolError,
    httpx.DecodingError,
    EngineUnavailable,
    RemoteStreamError,
)


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
    resumes = True  # a yaied daemon takes resume_token_ids
    forwards = True  # and X-Yaied-Via

    def __init__(
        self,
        engine_id: str,
        entry: EngineEntry,
        router_config: RouterConfig,
        *,
        transport: httpx.AsyncBaseTransport | None = None,  # tests: a mock daemon
        instance_id: str = "",  # this daemon's (the manager's): a remote answering it is us
    ) -> None:
        super().__init__(engine_id)
        self._transport = transport
        self.instance_id = instance_id
        self.refusal: str | None = None  # why it is refused for good (it is this daemon)
        self.bad_report: str | None = None  # why its probe's answers are unusable (said once)
        self.url = entry.url.rstrip("/")
        self.api_key = entry.key
        self.interval = router_config.health_check_interval_seconds
        self.max_connections = router_config.remote_max_connections
        self.read_timeout = router_config.remote_read_timeout_seconds
        self.breaker = CircuitBreaker(
            router_config.failure_threshold, router_config.success_threshold
        )
        self._client: httpx.AsyncClient | None = None  # the calls' streams
        self._probe_client: httpx.AsyncClient | None = None
        self._readers: dict[str, asyncio.Task] = {}
        self._stats: Stats | None = None
        self._prober: asyncio.Task | None = None

    async def start(self) -> None:
        """Connect and learn the model's limits; an unreachable daemon starts down and is probed
        (it may come up after the router)."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        headers |= ACCEPT_IDENTITY  # what is read is bounded as sent (remote_stream.py)
        # Between tokens a stream may idle, but the remote sends an SSE ping every
        # sse_ping_seconds: silence past the read timeout is a dead remote. No pool timeout:
        # a call waiting for a connection is queued, as it would be in the remote's queue.
        timeout = httpx.Timeout(_CONNECT_TIMEOUT, read=self.read_timeout, pool=None)
        limits = httpx.Limits(max_connections=self.max_connections, max_keepalive_connections=64)
        self._client = httpx.AsyncClient(
            base_url=self.url,
            headers=headers,
            timeout=timeout,
            limits=limits,
            transport=self._transport,
        )
        self._probe_client = httpx.AsyncClient(
            base_url=self.url, headers=headers, timeout=_PROBE_TIMEOUT, transport=self._transport
        )
        up = await self._probe()
        self.health = Health.UP if up else Health.DOWN
        self.breaker.up = up
        if self.refusal is not None:
            log.error("%s", self.refusal)
            return
        if not up and self.bad_report is None:  # else said already, with the reason
            log.warning("remote engine %s (%s) does not answer; probing", self.engine_id, self.url)
        self._prober = asyncio.get_running_loop().create_task(self._probe_forever())

    async def _probe(self) -> bool:
        try:
            health, _ = await self._get("/health")
            if self.instance_id and health.headers.get(INSTANCE_HEADER) == self.instance_id:
                self.refusal = (
                    f"remote engine {self.engine_id} ({self.url}) is this daemon itself: its calls "
                    "would come back here in a loop; refused (give another daemon's URL)"
                )
                return False
            if health.status_code != 200:
                return False
            # Read at every probe: the remote may be a pool whose largest engine changes.
            _, models = await self._get("/v1/models")
            reason = self._take_context_length(json.loads(models)["data"][0])
            if reason is None:
                metrics, text = await self._get("/metrics")
                ok = metrics.status_code == 200
                self._stats = stats_from_metrics(text.decode(errors="replace")) if ok else None
        except RemoteStreamError as exc:  # Oversized, or a body in an encoding not read
            reason = f"remote engine {self.engine_id} ({self.url}) sent {exc}; down until it stops"
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError, AttributeError):
            return False
        self._report(reason)
        return reason is None

    async def _get(self, path: str) -> tuple[httpx.Response, bytes]:
        """A probe's GET: the response (its status and headers) and its body, read up to
        MAX_PROBE_BYTES (past that, BodyTooLarge)."""
        assert self._probe_client is not None
        async with self._probe_client.stream("GET", path) as response:
            return response, await read_body(response, MAX_PROBE_BYTES, f"a {path} body")

    def _take_context_length(self, card: dict[str, Any]) -> str | None:
        """The context length the remote reports, as its limit: none is unknown (0: the front
        end's limit holds); one that is no length at all (not an integer, 0 or less, beyond
        MAX_CONTEXT_TOKENS) is returned as the reason the remote stays down."""
        reported = card.get("max_model_len")
        if "max_model_len" not in card or (
            type(reported) is int and 0 < reported <= MAX_CONTEXT_TOKENS
        ):
            reported = reported or 0
            known = self.info is not None and self.bad_report is None
            if known and self.info.max_model_len != reported:
                log.info("remote engine %s now holds %d tokens", self.engine_id, reported)
            self.info = ModelInfo(reported, 0)
            return None
        shown = repr(reported)[:60]
        return (
            f"remote engine {self.engine_id} ({self.url}) reports max_model_len {shown}, "
            f"not a context length (1 to {MAX_CONTEXT_TOKENS} tokens); down until it reports one"
        )

    def _report(self, reason: str | None) -> None:
        """What a probe's answers said that leaves the remote down (None: nothing): said once
        while it lasts, and shown in describe(); the next probe reads them again."""
        if reason is not None and reason != self.bad_report:
            log.error("%s", reason)
        elif reason is None and self.bad_report is not None:
            assert self.info is not None
            held = self.info.max_model_len
            log.info("remote engine %s answers well again (max_model_len %d)", self.engine_id, held)
        self.bad_report = reason

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            ok = await self._probe()
            if self.refusal is not None:  # this daemon under another name: down for good
                log.error("%s", self.refusal)
                self.health, self._stats = Health.DOWN, None
                self._lost()
                return
            self._record(ok)

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

    async def stop(self, timeout: float = 15.0) -> None:  # closing sockets does not wait
        if self._prober is not None:
            self._prober.cancel()
        for reader in list(self._readers.values()):
            reader.cancel()
        await asyncio.gather(*self._readers.values(), return_exceptions=True)
        for client in (self._client, self._probe_client):
            if client is not None:
                await client.aclose()
        self.health = Health.STOPPED

    def supports(self, params: SamplingParams) -> bool:
        # The OpenAI logprobs format names tokens by text; the router could not map them back.
        # Nor does a daemon's /v1/completions return pooled hidden states (embeddings).
        return params.logprobs is None and params.prompt_logprobs is None and not params.pooling

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
        via: Sequence[str] = (),
    ) -> None:
        if self.health is not Health.UP or self._client is None:
            raise EngineUnavailable(f"remote engine {self.engine_id} is {self.health.value}")
        headers = {"X-Request-Id": header_safe(request_id)}
        if session_id is not None:  # may be any string (the OpenAI `user`): encoded
            headers["X-Session-Id"] = header_safe(session_id)
        if self.instance_id:  # the daemons it passed through, and this one
            headers[VIA_HEADER] = ",".join((*via, self.instance_id))
        body = request_body(prompt_ids, params, priority, output_ids)
        reader = asyncio.get_running_loop().create_task(
            self._read(request_id, (len(prompt_ids), len(output_ids)), body, headers, sink)
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
        num_tokens: tuple[int, int],  # the prompt's, and the output's sent before
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
                async for event in sse_events(response, request_id, *num_tokens):
                    sink.deliver(event)
        except asyncio.CancelledError:
            sink.deliver(TokenEvent(request_id, [], "", FinishReason.ABORT))
            raise
        except _ENGINE_FAULTS as exc:
            if isinstance(exc, Oversized) and self.breaker.up:  # no daemon does that: down
                log.error("remote engine %s (%s) sent %s", self.engine_id, self.url, exc)
                self.breaker.failures = self.breaker.failure_threshold - 1  # now, not in 3 calls
            self._record(False)
            sink.lost(f"remote engine {self.engine_id}: {exc!r}")
        except httpx.PoolTimeout as exc:  # only with a pool timeout: busy, not broken
            sink.lost(f"remote engine {self.engine_id}: {exc!r}")
        except Exception as exc:  # the call's own fault (or a bug here): it alone ends
            log.warning("%s on remote engine %s failed: %r", request_id, self.engine_id, exc)
            error = f"the call to remote engine {self.engine_id} failed: {exc!r}"
            sink.deliver(TokenEvent(request_id, [], "", FinishReason.ERROR, error=error))

    async def _refused(
        self, request_id: str, response: httpx.Response
    ) -> TokenEvent | EngineUnavailable:
        """A non-200 answer: the engine's trouble (5xx, 429: try elsewhere) or the call's (4xx).
        A body past MAX_ERROR_BYTES raises BodyTooLarge: the engine's fault, as a broken stream."""
        body = await read_body(response, MAX_ERROR_BYTES, "an error body")
        text = body.decode(errors="replace")
        code = None
        with contextlib.suppress(ValueError, KeyError, TypeError):
            error = orjson.loads(text)["error"]
            text, code = str(error["message"]), error.get("code")
        status = response.status_code
        if status == 508 and code == LOOP_CODE:  # the call came round: elsewhere, no failure
            return EngineUnavailable(f"remote engine {self.engine_id}: {text}")
        if status >= 500:
            self._record(False)
        if status >= 500 or status == 429:
            return EngineUnavailable(f"remote engine {self.engine_id}: {status} {text}")
        return TokenEvent(request_id, [], "", FinishReason.ERROR, error=f"{status}: {text}")

    def stats(self) -> Stats | None:
        return self._stats

    def describe(self) -> dict[str, Any]:
        where: dict[str, Any] = {"url": self.url}
        if self.refusal is not None or self.bad_report is not None:
            where["error"] = self.refusal or self.bad_report
        return where


async def instance_at(url: str, api_key: str = "", timeout: float = 3.0) -> str | None:
    """The instance id the daemon at ``url`` answers with; None when it does not answer in
    ``timeout`` seconds or sends none (not a yaied daemon, or an older one)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:  # the headers only: the body, whatever its size, is never read
        async with (
            httpx.AsyncClient(timeout=timeout, headers=headers) as client,
            client.stream("GET", url.rstrip("/") + "/health") as response,
        ):
            return response.headers.get(INSTANCE_HEADER)
    except httpx.HTTPError:
        return None
