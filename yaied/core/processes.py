"""What every process yaied spawns shares: dying with the process that spawned it, running at
the daemon's own priority, and a garbage collector that leaves the loaded model alone."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
from pathlib import Path


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


def private_progress_lock() -> None:
    """Give tqdm a lock of this process's threads before anything draws a bar. Its first bar
    (even a disabled one: loading weights makes one) creates a multiprocessing RLock, which in a
    spawned process is a named semaphore registered with the resource tracker it shares with
    the daemon. Engine and rank processes end by os._exit (the teardown of torch's pools is
    skipped) or are killed, so the finalizer that would unregister it never runs, and the
    daemon's exit printed "resource_tracker: There appear to be N leaked semaphore objects",
    one for each process it had started. That lock orders the bars of the processes sharing it,
    and nothing shares it with a spawned process: a thread lock orders what this one draws."""
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())


def match_niceness(niceness: int) -> str | None:
    """Run every thread of this process at ``niceness`` (Linux: a thread's nice value is its own;
    threads started later inherit their starter's). Ray starts its worker processes at nice 15,
    below the daemon's and every other job on the machine, which starved engine actors on a
    shared box (W-sessions at 0.76x of local engine processes under load). Raising priority
    needs CAP_SYS_NICE or RLIMIT_NICE; without it, the reason, for the caller to log."""
    if not hasattr(os, "setpriority") or os.getpriority(os.PRIO_PROCESS, 0) == niceness:
        return None
    try:
        for task in Path("/proc/self/task").iterdir():
            with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                os.setpriority(os.PRIO_PROCESS, int(task.name), niceness)
    except FileNotFoundError:  # no /proc: this thread at least
        os.setpriority(os.PRIO_PROCESS, 0, niceness)
    except PermissionError:
        return (
            f"cannot run at nice {niceness} (now {os.getpriority(os.PRIO_PROCESS, 0)}): "
            "start Ray's nodes with RAY_worker_niceness=0, or grant CAP_SYS_NICE"
        )
    return None


def freeze_loaded_objects() -> None:
    """Move every object alive now out of the cyclic garbage collector's reach, once the model
    and its engine are loaded in a process that serves until it exits (the daemon, an engine
    process, a Ray engine actor). A full collection walks every tracked object: after a load,
    torch's and transformers' modules and the model's own, about 370,000 of them for the
    default model, and one such collection took 200 ms in the middle of a decode step (32 rows,
    a 52 ms step; scripts/step_overhead.py reports it as gc_longest_ms). Frozen, they
    are never walked again; what they hold is still freed by reference counting."""
    gc.collect()
    gc.freeze()


def release_unloaded_objects() -> None:
    """Give back what an engine removed from this process held (its weights, its KV pool):
    collect its reference cycles now (after ``freeze_loaded_objects`` the collector's next
    full pass may be far off), and hand the C heap's free pages back to the system, where
    glibc would keep them in the process's RSS."""
    gc.unfreeze()
    gc.collect()
    _trim_heap()


def _trim_heap() -> None:
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL(None).malloc_trim(0)


def describe_exit(exitcode: int | None) -> str:
    """A process's end in words, from multiprocessing's ``exitcode`` (or a Popen returncode):
    ``-N`` is a signal ("killed by signal 9 (SIGKILL)"), ``None`` an end not reaped yet."""
    if exitcode is None:
        return "exited (status unknown)"
    if exitcode >= 0:
        return f"exited with status {exitcode}"
    try:
        return f"killed by signal {-exitcode} ({signal.Signals(-exitcode).name})"
    except ValueError:  # a number with no name here
        return f"killed by signal {-exitcode}"
