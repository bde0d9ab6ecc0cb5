"""A fake remote yaied daemon on a real socket: /health, /v1/models and /metrics answer as a
daemon does, and POST /v1/completions streams SSE in one of these modes:

- ``ok``: a token, the final chunk (``stop``), the usage chunk, ``[DONE]``, after ``hold`` s;
- ``malformed``: a token, then a line that is not JSON;
- ``bad_finish``: a token, then a finish reason no daemon sends;
- ``slow``: a token every 50 ms for a long time (stop the process to make it fall silent);
- ``close``: a token, then the connection closes, with no finish and no ``[DONE]``;
- ``not_http``: a line that is not an HTTP response, then the connection closes;
- ``endless``: a token, then one line that never ends (no newline, ever), until the client
  leaves;
- ``error``: a token, then the error chunk a daemon sends when its engine fails the call
  (``ERROR_MESSAGE``, prefixed as the daemon's server prefixes it), ``[DONE]``;
- ``huge_error``: a 400 whose OpenAI error body is HUGE_BYTES long (its message padded);
- ``huge_models``, ``huge_metrics``: streams as ``ok``, but /v1/models (valid JSON, padded) or
  /metrics (valid Prometheus text, padded) is HUGE_BYTES long, above any bound on a body;
- ``gzip_metrics``, ``gzip_stream``: a gzip bomb, sent whatever the client's Accept-Encoding:
  /metrics as ``huge_metrics``, or the stream's second line (one that never ends, HUGE_BYTES),
  gzipped to a few kilobytes (``content-encoding: gzip``).

In-process (``async with FakeRemote(mode) as remote``) or as a process of its own, which prints
its port and serves until killed: ``python -m tests.router.fake_remote MODE``.
"""

from __future__ import annotations

import asyncio
import functools
import sys
import zlib

import orjson

_MODES = (
    "ok",
    "malformed",
    "bad_finish",
    "slow",
    "close",
    "not_http",
    "error",
    "endless",
    "huge_error",
    "huge_models",
    "huge_metrics",
    "gzip_metrics",
    "gzip_stream",
)
ERROR_MESSAGE = "the engine ran out of KV pages"  # what mode ``error``'s engine says
HUGE_BYTES = 16 << 20  # what the huge_* modes send: finite (a test without a bound ends)


def _chunk(finish: str | None = None, ids: tuple[int, ...] = (5,)) -> bytes:
    choice = {"index": 0, "text": "a", "token_ids": list(ids), "finish_reason": finish}
    return b"data: " + orjson.dumps({"choices": [choice]}) + b"\n\n"


def _padded(body: bytes, comment: bytes = b"") -> bytes:
    """``body`` and then blanks (a comment, given its start) up to HUGE_BYTES: still valid."""
    pad = HUGE_BYTES - len(body) - len(comment) - 1
    return body + b"\n" + comment + b" " * pad if comment else body + b" " * (pad + 1)


@functools.cache
def gzip_bomb(what: str) -> bytes:
    """The gzip_* modes' bodies (``what``: "metrics" or "stream"), HUGE_BYTES once decompressed,
    a few kilobytes as sent; built once (a test that measures memory builds them first)."""
    if what == "metrics":
        body = _padded(b'yaied:num_requests_waiting{engine="0"} 0\n', b"# ")
    else:
        body = _chunk() + b"data: " + b"a" * HUGE_BYTES
    return zlib.compress(body, wbits=zlib.MAX_WBITS | 16)


_USAGE = b"data: " + orjson.dumps({"choices": [], "usage": {"prompt_tokens": 2}}) + b"\n\n"


class FakeRemote:
    def __init__(self, mode: str = "ok", hold: float = 0.0) -> None:
        assert mode in _MODES, mode
        self.mode = mode
        self.hold = hold
        self.open_streams = 0
        self.peak_streams = 0
        self.headers: list[dict[str, str]] = []  # each completion request's headers
        self.probes = 0  # GET /health requests
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def __aenter__(self) -> FakeRemote:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, backlog=1024)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:  # keep-alive: one request after another on this connection
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
                headers = {k.lower(): v for k, v in headers.items()}
                await reader.readexactly(int(headers.get("content-length", 0)))
                if method == "POST" and path == "/v1/completions":
                    self.headers.append(headers)
                    await self._stream(writer)
                    return  # the stream ends with the connection
                await self._answer(writer, path)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass  # the client left, or the test's loop is closing
        finally:
            writer.close()

    async def _answer(self, writer: asyncio.StreamWriter, path: str) -> None:
        self.probes += path == "/health"
        bodies = {
            "/health": b"",
            "/v1/models": orjson.dumps({"data": [{"id": "m", "max_model_len": 512}]}),
            "/metrics": b'yaied:num_requests_waiting{engine="0"} 0\n',
        }
        encoding = b""
        if self.mode == "huge_models":
            bodies["/v1/models"] = _padded(bodies["/v1/models"])
        elif self.mode == "huge_metrics":
            bodies["/metrics"] = _padded(bodies["/metrics"], b"# ")
        elif self.mode == "gzip_metrics":
            bodies["/metrics"] = gzip_bomb("metrics")
            encoding = b"content-encoding: gzip\r\n" if path == "/metrics" else b""
        body = bodies.get(path, b"")
        status = "200 OK" if path in bodies else "404 Not Found"
        head = f"HTTP/1.1 {status}\r\ncontent-length: {len(body)}\r\n".encode() + encoding
        writer.write(head + b"\r\n" + body)
        await writer.drain()

    async def _stream(self, writer: asyncio.StreamWriter) -> None:
        self.open_streams += 1
        self.peak_streams = max(self.peak_streams, self.open_streams)
        try:
            if self.mode == "not_http":
                writer.write(b"SSH-2.0-OpenSSH_9.6\r\n")
                await writer.drain()
                return
            if self.mode == "huge_error":
                message = "bad request " + "x" * HUGE_BYTES
                body = orjson.dumps({"error": {"message": message, "code": 400}})
                writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n")
                writer.write(f"content-length: {len(body)}\r\n\r\n".encode() + body)
                await writer.drain()
                return
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n")
            if self.mode == "gzip_stream":
                writer.write(b"content-encoding: gzip\r\nconnection: close\r\n\r\n")
                writer.write(gzip_bomb("stream"))
                await writer.drain()
                return
            writer.write(b"connection: close\r\n\r\n" + _chunk())
            await writer.drain()
            await asyncio.sleep(self.hold)
            if self.mode in ("ok", "huge_models", "huge_metrics"):
                writer.write(_chunk("stop", ()) + _USAGE + b"data: [DONE]\n\n")
            elif self.mode == "malformed":
                writer.write(b'data: {"choices": [{"text": \n\n')
            elif self.mode == "bad_finish":
                writer.write(_chunk("exploded", ()) + _USAGE + b"data: [DONE]\n\n")
            elif self.mode == "error":
                error = {
                    "message": f"generation failed: {ERROR_MESSAGE}",
                    "type": "server_error",
                    "param": None,
                    "code": "engine_error",
                }
                writer.write(b"data: " + orjson.dumps({"error": error}) + b"\n\n")
                writer.write(b"data: [DONE]\n\n")
            elif self.mode == "endless":
                writer.write(b'data: {"choices": [{"text": "')
                while True:  # until the client closes the connection
                    writer.write(b"a" * 65536)
                    await writer.drain()
            elif self.mode == "close":
                pass  # the connection closes on the way out
            else:
                for _ in range(100_000):
                    writer.write(_chunk())
                    await writer.drain()
                    await asyncio.sleep(0.05)
            await writer.drain()
        finally:
            self.open_streams -= 1


async def _main(mode: str) -> None:
    async with FakeRemote(mode) as remote:
        print(remote.url, flush=True)
        await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(_main(sys.argv[1]))
