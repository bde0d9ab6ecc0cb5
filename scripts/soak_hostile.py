"""The soak's hostile mix (scripts/soak.py --hostile): clients that break the rules, among normal
ones. Each kind expects a definite answer from the daemon, never a 5xx and never silence:

- ``oversized``: a body past server.max_body_bytes (413), 5,000 prompts x n = 128 (400), a
  1 MB `user` (400), 1,000 stop strings (400);
- ``malformed``: broken JSON (400), a text/plain body (415), a rebinding Host (400);
- ``slow_upload``: half a body, then nothing: 408 once server.body_timeout_seconds pass;
- ``slow_reader``: a long stream on a 4 KB receive buffer, not read for seconds, then closed;
- ``disconnect``: a request cut off mid-body, or closed as soon as it is sent.

Each runs over a raw socket where httpx would not misbehave as asked, and reports the status
line it got (or ``closed``). ``hostile_loop`` keeps them coming until the normal load is done.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
from urllib.parse import urlsplit

KINDS = ("oversized", "malformed", "slow_upload", "slow_reader", "disconnect")
_PROMPT = [1, 2, 3]


def _request(path: str, body: bytes, host: str, *, content_type: str = "application/json") -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


async def _exchange(url: str, data: bytes, *, small_buffer: bool = False, read: bool = True) -> str:
    """Send ``data``; the response's status code, or "closed"."""
    parts = urlsplit(url)
    sock = socket.socket()
    if small_buffer:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    try:
        await loop.sock_connect(sock, (parts.hostname, parts.port))
        await loop.sock_sendall(sock, data)
        if not read:
            return "sent"
        first = await asyncio.wait_for(loop.sock_recv(sock, 4096), 60)
        return first.split(b" ", 2)[1].decode() if first.startswith(b"HTTP/") else "closed"
    except (ConnectionError, OSError):
        return "closed"
    finally:
        sock.close()


async def hostile_request(url: str, kind: str, rng: random.Random) -> str:
    """One hostile client of ``kind``; returns what the daemon answered."""
    host = urlsplit(url).netloc
    path = "/v1/completions"
    if kind == "oversized":
        body = rng.choice(
            [
                {"prompt": "x" * (8 * 1024 * 1024 + 1)},
                {"prompt": [_PROMPT] * 5000, "n": 128},
                {"prompt": _PROMPT, "user": "u" * (1 << 20)},
                {"prompt": _PROMPT, "stop": [f"s{i}" for i in range(1000)]},
            ]
        )
        return await _exchange(url, _request(path, json.dumps(body).encode(), host))
    if kind == "malformed":
        good = json.dumps({"prompt": _PROMPT, "max_tokens": 4}).encode()
        data = rng.choice(
            [
                _request(path, b'{"prompt": [1, 2', host),
                _request(path, good, host, content_type="text/plain"),
                _request(path, good, "rebound.example"),
            ]
        )
        return await _exchange(url, data)
    if kind == "slow_upload":
        data = _request(path, b'{"prompt": [1, 2, 3], "max_tokens": 4}', host)
        return await _exchange(url, data[: len(data) - 10])  # 408 after the body deadline
    if kind == "slow_reader":
        body = {"prompt": _PROMPT, "max_tokens": 64, "n": 4, "stream": True, "ignore_eos": True}
        parts = urlsplit(url)
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port, limit=4096)
        writer.transport.set_write_buffer_limits(0)
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        writer.write(_request(path, json.dumps(body).encode(), host))
        await writer.drain()
        status = (await asyncio.wait_for(reader.readline(), 60)).split(b" ", 2)[1].decode()
        writer.transport.pause_reading()  # and read no more for a while
        await asyncio.sleep(rng.uniform(1, 4))
        writer.close()
        return status
    # disconnect: mid-body, or right after sending
    body = json.dumps({"prompt": _PROMPT, "max_tokens": 32, "stream": True}).encode()
    data = _request(path, body, host)
    if rng.random() < 0.5:
        data = data[: len(data) // 2]
    return await _exchange(url, data, read=False)


async def hostile_loop(url: str, done: asyncio.Event, seed: int, clients: int) -> list[str]:
    """``clients`` hostile clients at a time until ``done``; every answer as "<kind> <status>"."""
    rng = random.Random(seed)
    results: list[str] = []

    async def client() -> None:
        while not done.is_set():
            kind = rng.choice(KINDS)
            try:
                status = await hostile_request(url, kind, rng)
            except TimeoutError:
                status = "hung"
            except (ConnectionError, OSError, IndexError):
                status = "closed"
            results.append(f"{kind} {status}")
            await asyncio.sleep(rng.uniform(0, 0.2))

    await asyncio.gather(*(client() for _ in range(clients)))
    return results
