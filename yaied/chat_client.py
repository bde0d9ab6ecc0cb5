"""The HTTP side of `yaied chat --url`: a running daemon's chat API, one streamed answer at a time.

The terminal loop stays in cli.py; this module only speaks the protocol. Two failures differ:
``ServerUnreachable`` (nothing listens there: the chat cannot go on) and ``ServerError`` (the
server answered with an error, before or inside the stream: that turn failed, the chat goes on).
What the server sends is checked as it is read: a stream that is not SSE, whose chunks are not
OpenAI chat chunks, that ends before ``[DONE]``, or whose line runs past MAX_LINE_BYTES (a line
that never ends) is a ServerError, one line, having held no more than that line.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx

from yaied.core.bounded import (
    ACCEPT_IDENTITY,
    BadEncoding,
    BodyBuffer,
    Decoder,
    LineSplitter,
    TooLong,
)

# Connecting should be quick; an answer may pause for long (the server pings idle streams).
TIMEOUT = httpx.Timeout(10.0, read=300.0)
# A line of the stream: a chunk is well under a kilobyte. A server that sends more without a
# newline is broken (or not a chat server).
MAX_LINE_BYTES = 1 << 20
# A whole body: /v1/models (a few models, a kilobyte each), an error (a message).
MAX_BODY_BYTES = 4 << 20


class ServerUnreachable(Exception):
    """No connection to the daemon."""


class ServerError(Exception):
    """The daemon answered with an error; the message is the server's (``status``: the HTTP
    status of an error response, None for an error inside a stream)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def api_root(url: str) -> str:
    """``http://host:8000``, given that, ``http://host:8000/v1`` or the chat endpoint itself,
    ``http://host:8000/v1/chat/completions`` (each with or without a slash)."""
    return url.rstrip("/").removesuffix("/chat/completions").removesuffix("/v1")


class ChatClient:
    def __init__(self, url: str, api_key: str | None = None) -> None:
        self.root = api_root(url)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.sends_key = bool(api_key)
        headers |= ACCEPT_IDENTITY  # the bounds below count the bytes as sent
        try:
            self.http = httpx.Client(base_url=self.root, headers=headers, timeout=TIMEOUT)
        except httpx.InvalidURL as exc:  # say "http://[::1": no server to reach there
            raise ServerUnreachable(f"{url} is not a valid URL: {exc}") from None

    def close(self) -> None:
        self.http.close()

    def first_model(self) -> str:
        """The first id in ``/v1/models``: what the daemon serves."""
        with self._request("GET", "/v1/models") as response:
            body = self._checked(response, "/v1/models")
        models = body.get("data") if isinstance(body, dict) else None
        if not models or not isinstance(models[0], dict) or "id" not in models[0]:
            raise ServerError(f"{self.root}/v1/models lists no model")
        return str(models[0]["id"])

    def stream_chat(self, body: dict[str, Any]) -> Iterator[str]:
        """POST ``body`` with ``stream: true``; yield the content deltas as they arrive.

        Closing the iterator early (Ctrl-C) closes the response, so the server aborts the request.
        """
        with self._request("POST", "/v1/chat/completions", json={**body, "stream": True}) as resp:
            if resp.status_code != 200:
                self._checked(resp)  # raises ServerError with the server's message
            kind = resp.headers.get("content-type", "text/event-stream")
            if not kind.lower().startswith("text/event-stream"):
                raise ServerError(f"the answer from {self.root} is {kind}, not an event stream")
            try:
                for line in _lines(resp):
                    if not line.startswith("data:"):
                        continue  # blank separators and ": ping" comments
                    data = line.removeprefix("data:").strip()
                    if data == "[DONE]":
                        return
                    yield from _contents(json.loads(data))
            except httpx.TransportError as exc:
                raise ServerError(f"the stream from {self.root} broke: {exc}") from None
            except TooLong as exc:
                raise ServerError(f"the stream from {self.root} sent {exc}") from None
            except ValueError as exc:  # not JSON, or not a chat chunk
                raise ServerError(f"a malformed stream chunk from {self.root}: {exc}") from None
        raise ServerError(f"the stream from {self.root} ended before [DONE]; the answer is cut")

    def _checked(self, response: httpx.Response, what: str = "") -> Any:
        """_json_body, with a 401 to a chat that sent no key saying how to send one (the
        server's "missing or invalid API key" names no flag)."""
        try:
            return _json_body(response, what)
        except ServerError as exc:
            if exc.status != 401 or self.sends_key:
                raise
            hint = "; pass one with --api-key KEY or $YAIED_API_KEY"
            raise ServerError(f"{exc}{hint}", exc.status) from None

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        """A streaming response as a context manager, with connection failures translated."""
        return _Translated(self, self.http.stream(method, path, **kwargs))


class _Translated:
    # httpx opens the connection in __enter__; that is where "connection refused" surfaces.
    def __init__(self, client: ChatClient, stream: Any) -> None:
        self.client, self.stream = client, stream

    def __enter__(self) -> httpx.Response:
        try:
            return self.stream.__enter__()
        except httpx.ConnectError as exc:
            raise ServerUnreachable(f"cannot connect to {self.client.root}: {exc}") from None
        except httpx.TransportError as exc:
            raise ServerError(f"request to {self.client.root} failed: {exc}") from None

    def __exit__(self, *exc_info: object) -> None:
        self.stream.__exit__(*exc_info)


def _chunks(response: httpx.Response) -> Iterator[bytes]:
    """The body, decompressed in pieces (core/bounded.py's Decoder: the bounds hold on what a
    compressed body expands to); an encoding it does not read raises ServerError. A response
    built whole (a mock transport's) was read and decoded when it was made: its content is all."""
    if response.is_stream_consumed:
        yield response.content
        return
    try:
        decoder = Decoder(response.headers.get("content-encoding"))
        for raw in response.iter_raw():
            yield from decoder.feed(raw)
    except BadEncoding as exc:
        raise ServerError(f"{response.url} sent {exc}") from None


def _lines(response: httpx.Response) -> Iterator[str]:
    """The body's lines, each of at most MAX_LINE_BYTES (past that, TooLong)."""
    lines = LineSplitter(MAX_LINE_BYTES)
    for chunk in _chunks(response):
        yield from lines.feed(chunk)
    yield from lines.end()


def _contents(chunk: Any) -> list[str]:
    """One chat chunk's content deltas; an error chunk raises ServerError with its message, a
    chunk that is no chat chunk ValueError."""
    if not isinstance(chunk, dict):
        raise ValueError(f"{type(chunk).__name__}, not a JSON object")
    if "error" in chunk:
        raise ServerError(_message(chunk))
    choices = chunk.get("choices") or []
    if not isinstance(choices, list):
        raise ValueError("choices is not a list")
    contents = []
    for choice in choices:
        if not isinstance(choice, dict):
            raise ValueError("a choice is not an object")
        delta = choice.get("delta") or {}
        if not isinstance(delta, dict):
            raise ValueError("a choice's delta is not an object")
        content = delta.get("content")
        if content is not None and not isinstance(content, str):
            raise ValueError("a delta's content is not a string")
        if content:
            contents.append(content)
    return contents


def _json_body(response: httpx.Response, what: str = "") -> Any:
    """The JSON of a 200 response (``what``: its path, for the errors); any other status raises
    ServerError with the server's words. The body is read up to MAX_BODY_BYTES."""
    name = f"a {what} body" if response.status_code == 200 else "an error body"
    content = BodyBuffer(MAX_BODY_BYTES)
    try:
        for chunk in _chunks(response):
            content.feed(chunk)
    except TooLong:
        raise ServerError(f"{response.url} sent {name} of over {MAX_BODY_BYTES} bytes") from None
    try:
        body = json.loads(content.value())
    except ValueError:
        body = None
    if response.status_code != 200:
        if isinstance(body, dict) and "error" in body:
            raise ServerError(_message(body), response.status_code)
        text = " ".join(content.value().decode(errors="replace").split())
        message = f"HTTP {response.status_code}: {text or response.reason_phrase}"
        raise ServerError(message, response.status_code)
    return body


def _message(body: dict[str, Any]) -> str:
    error = body.get("error")
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)
