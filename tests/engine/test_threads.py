"""Only the worker thread holds an OpenMP team (yaied/engine/threads.py): a parallel torch op on
another live thread would start one, and with more OpenMP threads than CPUs libgomp slows every
engine step. A team shows up as new OS threads of the process, which is what these count, each
case in a fresh interpreter: in the test process other tests' threads come and go."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not os.path.isdir("/proc/self/task") or (os.cpu_count() or 1) < 2,
    reason="needs Linux's /proc and at least two cores",
)

# Runs `work` on a thread that stays alive, and prints the OS threads it left beyond its own.
PROBE = """
import os, threading
import torch
from yaied.engine.threads import run_torch_serially
from yaied.structured.matcher import allocate_bitmask

def work():
{work}

def count():
    return len(os.listdir("/proc/self/task"))

# torch.set_num_threads also sizes a pthreadpool of its own (not OpenMP), whose threads start
# on first use: started here, before the count. Two threads, as on a machine with two cores.
torch.set_num_threads(2)
done, release = threading.Event(), threading.Event()

def run():
    work()
    done.set()
    release.wait()

before = count()
thread = threading.Thread(target=run)
thread.start()
assert done.wait(60)
print(count() - before - 1)
release.set()
thread.join()
"""


def threads_started_by(work: str) -> int:
    script = PROBE.format(work=textwrap.indent(textwrap.dedent(work), "    "))
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    return int(result.stdout.strip().splitlines()[-1])


BIG_PARALLEL_OP = "torch.ones(4_000_000).mul_(2.0)"  # far above torch's grain size


def test_a_parallel_op_on_a_live_thread_starts_a_team():
    # The control: what the other tests prevent does happen.
    assert threads_started_by(BIG_PARALLEL_OP) >= 1


def test_a_serial_thread_starts_no_team():
    work = f"""
    run_torch_serially()
    {BIG_PARALLEL_OP}
    assert torch.get_num_threads() == 1
    """
    assert threads_started_by(work) == 0


def test_the_bitmask_is_allocated_without_a_team():
    # StepMasks allocates it on the engine loop's thread, which in the offline LLM is the
    # caller's and keeps its thread count.
    assert threads_started_by("allocate_bitmask(1024, 152_064)") == 0


def test_the_bitmask_allows_every_token():
    from yaied.structured.matcher import allocate_bitmask

    host = allocate_bitmask(3, 100).host
    assert host.shape == (3, 4) and host.dtype == torch.int32 and bool((host == -1).all())


def test_the_worker_keeps_its_threads_when_the_loop_goes_serial(tiny_model_dirs):
    """The loop thread goes serial after the worker has started: the worker keeps its own
    count (torch applies its default to a thread at its first parallel op; the worker fixes its
    count when it starts)."""
    from yaied import LLM

    llm = LLM(str(tiny_model_dirs["llama"]), threads=2, kv_cache_gib=0.01, show_progress=False)
    done = threading.Event()
    try:

        def loop_thread() -> None:
            llm.engine.keep_this_thread_serial()
            done.set()

        thread = threading.Thread(target=loop_thread)
        thread.start()
        thread.join()
        assert done.is_set()

        def first_parallel_op() -> int:
            torch.ones(4_000_000).mul_(2.0)
            return torch.get_num_threads()

        assert llm.engine._executor.submit(first_parallel_op).result() == 2
    finally:
        llm.close()
        torch.set_num_threads(os.cpu_count() or 1)  # the serial call set torch's default
