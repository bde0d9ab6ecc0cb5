"""One thread owns the cores: torch work on any other thread of an engine's process runs serially.

libgomp (torch's OpenMP runtime on Linux) gives every thread that starts a parallel region a
team of worker threads of its own, alive as long as that thread is. Once the process holds more
OpenMP threads than it has CPUs, libgomp throttles the spin-wait of every barrier, and each
parallel op of the engine's worker thread then waits on a futex instead of spinning: after one
parallel op on the daemon's event-loop thread (a 256-row bitmask fill), every later batch-1 decode
step on 2 cores took 20-40% longer, for the life of the process. A team goes away only with its
thread. The worker thread is the one that needs intra-op parallelism; the engine's other threads
(the event loop of the daemon and of engine processes, grammar compiles) are kept to one thread,
so they never start a team. OpenMP's thread count is per thread, but torch.set_num_threads also
sets torch's default, which torch applies to a thread at its first parallel op: the worker fixes
its own count when it starts (worker.py), so setting one here leaves it alone.
"""

from __future__ import annotations

import torch


def run_torch_serially() -> None:
    """From now on, torch ops issued from the calling thread run on that thread alone."""
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)
