"""sd_notify over $NOTIFY_SOCKET: messages arrive, the watchdog stops when the engine dies."""

from __future__ import annotations

import asyncio
import socket

from tests.waiting import async_wait_until
from yaied.systemd_notify import SystemdNotifier


def receiver(tmp_path) -> tuple[socket.socket, str]:
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(2)
    return sock, path


def test_notify_sends_datagrams(tmp_path):
    sock, path = receiver(tmp_path)
    with sock:
        SystemdNotifier({"NOTIFY_SOCKET": path}).notify("READY=1")
        assert sock.recv(64) == b"READY=1"


def test_without_notify_socket_everything_is_a_no_op():
    notifier = SystemdNotifier({})
    assert not notifier.enabled and notifier.watchdog_seconds is None
    notifier.notify("READY=1")
    asyncio.run(notifier.feed_watchdog(lambda: True))  # returns at once


def test_abstract_socket_names_and_watchdog_pid():
    notifier = SystemdNotifier(
        {"NOTIFY_SOCKET": "@yaied", "WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "1"}
    )
    assert notifier.address == "\0yaied"
    assert notifier.watchdog_seconds is None  # the watchdog is another process's


async def test_watchdog_is_fed_only_while_alive(tmp_path):
    sock, path = receiver(tmp_path)
    sock.setblocking(False)
    alive = [True]
    notifier = SystemdNotifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "40000"})
    task = asyncio.create_task(notifier.feed_watchdog(lambda: alive[0]))
    fed = 0

    def fed_twice() -> bool:
        nonlocal fed
        fed += _drain(sock)
        return fed >= 2

    await async_wait_until(fed_twice, timeout=10, what="two watchdog feeds")
    alive[0] = False
    await asyncio.sleep(0.02)  # a feed already under way when the engine stopped
    _drain(sock)
    # An absence, so a window rather than a condition: no feed in five watchdog periods.
    await asyncio.sleep(0.1)
    starved = _drain(sock)
    task.cancel()
    sock.close()
    assert fed >= 2 and starved == 0


def _drain(sock: socket.socket) -> int:
    count = 0
    while True:
        try:
            assert sock.recv(64) == b"WATCHDOG=1"
            count += 1
        except BlockingIOError:
            return count
