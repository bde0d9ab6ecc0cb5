"""Waiting on a condition, not for a fixed time: a sleep long enough on a loaded CI box is slow
everywhere else, and one short enough is flaky there."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


def wait_until(
    condition: Callable[[], object], timeout: float = 30.0, what: str = "the condition"
) -> None:
    """Poll `condition` until it holds; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.01)


async def async_wait_until(
    condition: Callable[[], object], timeout: float = 30.0, what: str = "the condition"
) -> None:
    """wait_until, yielding to the event loop between polls."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        await asyncio.sleep(0.01)
