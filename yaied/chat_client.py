"""The HTTP side of `yaied chat --url`: a running daemon's chat API, one streamed answer at a time.

The terminal loop stays in cli.py; this module only speaks the protocol. Two failures differ:
``ServerUnreachable`` (nothing listens there: the chat cannot go on) and ``ServerError`` (the
server answered with an error, before or inside the stream: that turn failed, the chat goes on).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx

# Connecting should be quick; an answer may pause for long (the server pings idle streams).
TIMEOUT = httpx.Timeout(10.0, read=300.0)


class ServerUnreachable(Exception):
    """No connection to the daemon."""


class ServerError(Exception):
    """The daemon answered with an error; the message is the server's."""


def api_root(url: str) -> str:
    """``http://host:8000``, given that, ``http://host:8000/v1`` or the chat endpoint itself,
    ``http://host:8000/v1/chat/completions`` (each with or without a slash)."""
    return url.rstrip("/").removesuffix("/chat/completions").removesuffix("/v1")


class ChatClient:
    def __init__(self, url: str, api_key: str | None = None) -> None:
        self.root = api_root(url)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        try:
            self.http = httpx.Client(base_url=self.root, headers=headers, timeout=TIMEOUT)
        except httpx.InvalidURL as exc:  # say "http://[::1": no server to reach there
            raise ServerUnreachable(f"{url} is not a valid URL: {exc}") from None

    def close(self) -> None:
        self.http.close()

    def first_model(self) -> str:
        """The first id in ``/v1/models``: what the daemon serves."""
        with self._request("GET", "/v1/models") as response:
            body = _json_body(response)
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
                _json_body(resp)  # raises ServerError with the server's message
            try:
                for line in resp.iter_lines():
                    if not line.startswith("data:"):
                        continue  # blank separators and ": ping" comments
                    data = line.removeprefix("data:").strip()
                    if data == "[DONE]":
                        return
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise ServerError(_message(chunk))
                    for choice in chunk.get("choices") or ():
                        content = (choice.get("delta") or {}).get("content")
                        if content:
                            yield content
            except httpx.TransportError as exc:
                raise ServerError(f"the stream from {self.root} broke: {exc}") from None
            except json.JSONDecodeError as exc:
                raise ServerError(f"a malformed stream chunk from {self.root}: {exc}") from None

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


def _json_body(response: httpx.Response) -> Any:
    """The JSON of a 200 response; any other status raises ServerError with the server's words."""
    response.read()
    try:
        body = response.json()
    except ValueError:
        body = None
    if response.status_code != 200:
        if isinstance(body, dict) and "error" in body:
            raise ServerError(_message(body))
        text = " ".join(response.text.split()) or response.reason_phrase
        raise ServerError(f"HTTP {response.status_code}: {text}")
    return body


def _message(body: dict[str, Any]) -> str:
    error = body.get("error")
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)
