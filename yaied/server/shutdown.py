"""How a stop spends ``server.stop_timeout_seconds``, so that every mode exits before systemd's
``TimeoutStopSec`` (60 s in systemd/yaied.service) kills it.

From the signal on, in order, each phase gets at most its own cap and what the clock has left:

    drain        up to server.drain_timeout_seconds, keeping back min(20 s, half) for the rest
    abort wait   up to 5 s (a quarter of what is left): the aborted calls' final events
    close        up to 3 s (a quarter): uvicorn's graceful shutdown, responses finish writing
    load         a model still loading (a long conversion) is waited for up to half the rest,
                 then given up: the process exits without it (model_cache.py cleans up after)
    engines      the rest: engine processes asked to stop and joined, then killed

With the defaults (50 s, drain 30 s): 30 + 5 + 3 + 12, and 10 s of the unit's 60 to exit.
"""

from __future__ import annotations

import time

ABORT_WAIT_SECONDS = 5.0
CLOSE_SECONDS = 3.0
AFTER_DRAIN_SECONDS = 20.0  # abort wait + close + engines, at most
EXIT_SECONDS = 10.0  # the unit's TimeoutStopSec less stop_timeout_seconds: the process's own exit


class StopClock:
    """The time left of one stop, from the signal on."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def drain_seconds(self, drain_timeout: float) -> float:
        left = self.left()
        return max(0.0, min(drain_timeout, left - min(AFTER_DRAIN_SECONDS, left / 2)))

    def abort_wait_seconds(self) -> float:
        return min(ABORT_WAIT_SECONDS, self.left() / 4)

    def close_seconds(self) -> float:
        # Never 0: uvicorn reads 0 as "no limit".
        return max(0.01, min(CLOSE_SECONDS, self.left() / 4))

    def load_wait_seconds(self) -> float:
        return self.left() / 2
