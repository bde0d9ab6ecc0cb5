"""What every process yaied spawns shares: dying with the process that spawned it."""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import threading


def exit_with_parent(thread_name: str) -> None:
    """Exit this process (code 1) as soon as its multiprocessing parent is gone, whatever it is
    doing (loading, waiting in a collective): no engine or rank process outlives the one that
    spawned it. A no-op in a process multiprocessing did not start."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name=thread_name, daemon=True).start()
