"""sd_notify without libsystemd: datagrams to $NOTIFY_SOCKET, as systemd's protocol specifies.

With `Type=notify` systemd waits for READY=1 before it considers the service started, and with
`WatchdogSec=` it restarts a service that stops sending WATCHDOG=1. Outside systemd (no
$NOTIFY_SOCKET) every call is a no-op.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)


class SystemdNotifier:
    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        address = env.get("NOTIFY_SOCKET", "")
        # A leading "@" names a socket in the abstract namespace (a leading NUL byte).
        self.address = "\0" + address[1:] if address.startswith("@") else address
        usec = env.get("WATCHDOG_USEC", "")
        watchdog_pid = env.get("WATCHDOG_PID", "")
        mine = not watchdog_pid or watchdog_pid == str(os.getpid())
        self.watchdog_seconds = int(usec) / 1e6 if usec.isdigit() and mine else None

    @property
    def enabled(self) -> bool:
        return bool(self.address)

    def notify(self, message: str) -> None:
        if not self.address:
            return
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                # Never block the event loop: a reader that fell behind (a full queue) costs
                # this one message, not every request in flight.
                sock.setblocking(False)
                sock.sendto(message.encode(), self.address)
        except OSError as exc:  # systemd gone or socket unwritable: never fatal for serving
            log.warning("sd_notify %r failed: %s", message, exc)

    async def feed_watchdog(self, alive: Callable[[], bool]) -> None:
        """Send WATCHDOG=1 at half the interval while alive() holds; stop feeding when it does
        not, so systemd notices a dead engine loop and restarts the service."""
        if self.watchdog_seconds is None:
            return
        while True:
            if alive():
                self.notify("WATCHDOG=1")
            await asyncio.sleep(self.watchdog_seconds / 2)
