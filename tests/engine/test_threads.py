"""Only the worker thread holds an OpenMP team (yaied/engine/threads.py): a parallel torch op on
another live thread would start one, and with more OpenMP threads than CPUs libgomp slows every
engine step. A team shows up as new OS threads of the process, which is what these count."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import pytest
import torch

from yaied.engine.threads import run_torch_serially
from yaied.structured.matcher import allocate_bitmask

pytestmark = pytest.mark.skipif(
    not os.path.isdir("/proc/self/task") or torch.get_num_threads() < 2,
    reason="needs Linux's /proc and at least two torch threads",
)


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def threads_started_by(work: Callable[[], object]) -> int:
    """OS threads beyond its own that a thread running ``work`` leaves while it stays alive."""
    done, release = threading.Event(), threading.Event()

    def run() -> None:
        torch.set_num_threads(2)  # what a fresh thread gets on a machine with two or more cores
        work()
        done.set()
        release.wait()

    before = os_threads()
    thread = threading.Thread(target=run)
    thread.start()
    try:
        assert done.wait(60)
        return os_threads() - before - 1
    finally:
        release.set()
        thread.join()


def big_parallel_op() -> None:
    torch.ones(4_000_000).mul_(2.0)  # far above torch's grain size: parallel where it may be


def test_a_parallel_op_on_a_live_thread_starts_a_team():
    # The control: what the other tests prevent does happen.
    assert threads_started_by(big_parallel_op) >= 1


def test_a_serial_thread_starts_no_team():
    def work() -> None:
        run_torch_serially()
        big_parallel_op()
        assert torch.get_num_threads() == 1

    assert threads_started_by(work) == 0


def test_the_bitmask_is_allocated_without_a_team():
    # StepMasks allocates it on the engine loop's thread, which in the offline LLM is the
    # caller's and keeps its thread count.
    made = []
    assert threads_started_by(lambda: made.append(allocate_bitmask(1024, 152_064).host)) == 0
    assert made[0].shape == (1024, 4752) and bool((made[0] == -1).all())  # every token allowed
