"""core/processes.py: every thread of a process moved to one nice value; the loaded objects out
of the garbage collector's walk."""

import os
import subprocess
import sys

from yaied.core import processes

# In a child of its own (nice values only go down without privilege): two threads started
# before the call, one after, all at the new value.
CHILD = """
import os, threading
from pathlib import Path
from yaied.core.processes import match_niceness

def niceness_of_every_thread():
    return {
        int((task / "stat").read_text().rsplit(")", 1)[1].split()[16])
        for task in Path("/proc/self/task").iterdir()
    }

stop = threading.Event()
for _ in range(2):
    threading.Thread(target=stop.wait).start()
target = os.getpriority(os.PRIO_PROCESS, 0) + 3
assert match_niceness(target) is None
threading.Thread(target=stop.wait).start()
print(sorted(niceness_of_every_thread()), target)
stop.set()
"""


def test_every_thread_moves_to_the_niceness_and_new_ones_inherit_it():
    out = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    assert out[0] == f"[{out[-1]}]"  # one value, the target's, on all four threads


def test_a_refused_priority_is_a_reason_not_an_error(monkeypatch):
    def refuse(*args):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(processes.os, "setpriority", refuse)
    now = os.getpriority(os.PRIO_PROCESS, 0)
    problem = processes.match_niceness(now - 1)
    assert problem is not None and "RAY_worker_niceness=0" in problem
    assert processes.match_niceness(now) is None  # already there: nothing to do


# In a child of its own: the freeze is process-wide.
FREEZE_CHILD = """
import gc, weakref
from yaied.core.processes import freeze_loaded_objects

class Loaded:  # stands for a loaded module: in a cycle
    def __init__(self):
        self.me = self

gc.disable()  # no collection but the freeze's own
loaded = Loaded()
garbage = Loaded()
gone = weakref.ref(garbage)
del garbage  # a cycle nobody holds: collected by the freeze, not frozen with the rest
freeze_loaded_objects()
walked = any(o is loaded for o in gc.get_objects())  # the collector's generations
print(gc.get_freeze_count() > 0, gone() is None, walked)
"""


def test_the_loaded_objects_leave_the_collectors_walk():
    out = subprocess.run(
        [sys.executable, "-c", FREEZE_CHILD], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True", "False"]


# A daemon whose spawned process draws a (disabled) progress bar, as loading weights does, and
# ends by os._exit, as engine and rank processes do; argv[1] says whether the spawned process
# gives tqdm its own lock first.
SPAWNS_A_BAR = """
import multiprocessing, os, sys

def spawned(private):
    if private:
        from yaied.core.processes import private_progress_lock
        private_progress_lock()
    from tqdm import tqdm
    with tqdm(total=1, disable=True):
        pass
    os._exit(0)

if __name__ == "__main__":
    process = multiprocessing.get_context("spawn").Process(
        target=spawned, args=(sys.argv[1] == "private",)
    )
    process.start()
    process.join()
"""


def test_a_spawned_process_that_draws_a_bar_leaves_no_semaphore_behind(tmp_path):
    """`yaied serve --engines 2`, then SIGTERM: the daemon's exit printed the resource tracker's
    "There appear to be 2 leaked semaphore objects". The control run shows this check sees it."""
    script = tmp_path / "daemon.py"
    script.write_text(SPAWNS_A_BAR)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}

    def stderr_of(mode: str) -> str:
        done = subprocess.run(
            [sys.executable, str(script), mode], capture_output=True, text=True, env=env, timeout=60
        )
        assert done.returncode == 0, done.stderr
        return done.stderr

    assert "leaked semaphore" in stderr_of("shared")  # tqdm's own lock, as before
    assert "leaked semaphore" not in stderr_of("private"), stderr_of("private")
