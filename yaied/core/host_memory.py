"""The machine's memory, as a start sees it: what may still be taken, and whether the CPU engines
a config asks for fit in it. Pure Python over /proc and /sys/fs/cgroup (tests point both at
folders of fake files), so that the CLI checks before any engine loads or the daemon listens.

A CPU engine process holds three things that scale with the config:

    weights   its own copy of the model (estimated from the files: yaied/worker/weight_bytes.py)
    KV pool   cache.kv_cache_gib, once per tensor-parallel rank (each rank zeroes its own pool)
    overhead  PROCESS_OVERHEAD_BYTES per process (rank): Python, torch and its thread pools, the
              C kernels, the tokenizer, the step's activations at the default token budget

Past what the machine (or the cgroup, v2 or v1: a container, systemd's MemoryMax) has, the
kernel's OOM killer ends an engine mid-serve and a supervisor restarts it, into the same end.
GPU engines (their memory is the device's, sized by gpu_memory_utilization) and remote or Ray
engines (another machine's, or a node Ray picks) are not counted here.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from pathlib import Path

GIB = 2**30
# An engine process's resident memory beyond its weights and KV pool, measured after a first
# request (torch 2.13, x86-64, dtype auto, shared machine: indicative): 0.87 GiB for SmolLM2-135M
# (the interpreter with torch, transformers and yaied imported is 0.26 GiB of it), 0.36 GiB for a
# 0.4B-parameter dummy model under float32. Loading peaks above it (a dummy model's random init
# holds a second copy for a moment) are not counted: the check is for settings that cannot fit.
PROCESS_OVERHEAD_BYTES = GIB
# What every engine process takes at the least: the interpreter with torch and yaied imported
# (0.26 GiB measured). A start is refused only when it cannot fit even with this; between this
# and the estimate above it is a warning, so that the estimate never refuses one that would run.
PROCESS_LEAST_BYTES = GIB // 4
CGROUP_MOUNTS = Path("/sys/fs/cgroup")  # where cgroup hierarchies are mounted
HEADROOM = 0.10  # a start that leaves less than this share of available memory is warned about


def available_bytes(proc: Path = Path("/proc"), root: Path = CGROUP_MOUNTS) -> int | None:
    """What this process may still take: the kernel's MemAvailable, or less where a cgroup (a
    container, a systemd MemoryMax, or a slice above them) caps the process's group or one of
    its ancestors; None where neither is known. ``proc``, ``root``: where to read (tests).

    cgroup v2: the group of /proc/self/cgroup's "0::" line under ``root``, its memory.max.
    cgroup v1 (and hybrid hosts): the group of its memory controller's line ("N:memory:/path",
    or "N:cpu,memory:/path") under the controller's mount (``root``/memory, or a mount shared
    with other controllers, ``root``/cpu,memory: see _v1_memory_mount), its
    memory.limit_in_bytes; inside a container that path is the host's, not there: the
    container's own group is the mount's root.

    A group's room is its limit less its working set: its usage counts the page cache of files
    it read (model files, logs), which the kernel reclaims before it kills anyone, so the
    inactive files of memory.stat are not counted as taken. Never below 0."""
    found = []
    with contextlib.suppress(OSError, ValueError):
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    with contextlib.suppress(OSError):
        lines = (proc / "self" / "cgroup").read_text().splitlines()
        for line in lines:
            fields = line.split(":", 2)  # hierarchy:controllers:group
            if len(fields) != 3:
                continue
            hierarchy, controllers, group = fields
            if hierarchy == "0" and not controllers:  # the v2 hierarchy
                found += _rooms(root, root / group.lstrip("/"), _V2)
            elif "memory" in controllers.split(","):  # v1's memory controller
                mount, mount_root = _v1_memory_mount(proc, root)
                if group.startswith(mount_root.rstrip("/") + "/") or group == mount_root:
                    group = group[len(mount_root) :]  # the part under the mount's root
                folder = mount / group.lstrip("/")
                found += _rooms(mount, folder if folder.is_dir() else mount, _V1)
    return min(found) if found else None


def _v1_memory_mount(proc: Path, root: Path) -> tuple[Path, str]:
    """Where cgroup v1's memory controller is mounted, and the group its mount shows as its root
    ("/", or a container's own group): /proc/self/mountinfo's cgroup mount whose options name
    memory, alone or co-mounted with others (cpu,memory); a mount point under /sys/fs/cgroup is
    read under ``root``. Without mountinfo, ``root``'s folder named memory or with memory among
    its comma-separated names; ``root``/memory where there is none."""
    with contextlib.suppress(OSError):
        for line in (proc / "self" / "mountinfo").read_text().splitlines():
            # id parent major:minor root mount-point options [optional...] - type source super
            fields = line.split()
            if "-" not in fields[6:]:
                continue
            end = fields.index("-", 6)
            if fields[end + 1 : end + 2] != ["cgroup"] or len(fields) < end + 4:
                continue
            if "memory" in fields[end + 3].split(","):
                point = Path(_unescape(fields[4]))
                if point.is_relative_to(CGROUP_MOUNTS):
                    point = root / point.relative_to(CGROUP_MOUNTS)
                return point, _unescape(fields[3])
    with contextlib.suppress(OSError):
        for folder in sorted(root.iterdir()):
            if "memory" in folder.name.split(",") and folder.is_dir():
                return folder, "/"
    return root / "memory", "/"


def _unescape(field: str) -> str:
    """mountinfo writes a space, tab, newline and backslash in a path as \\ooo (octal)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


@dataclass(frozen=True, slots=True)
class _Files:
    """Where a cgroup version keeps a group's limit, usage and reclaimable file cache."""

    limit: str
    usage: str
    inactive_file: str  # memory.stat's key
    no_limit: int  # limits from this one up are none (v1: LONG_MAX rounded to a page)


_V2 = _Files("memory.max", "memory.current", "inactive_file", 2**63)  # "max": no limit
_V1 = _Files("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file", 2**62)


def _rooms(top: Path, folder: Path, files: _Files) -> list[int]:
    """The room of ``folder``'s group and of each ancestor up to ``top`` that has a limit."""
    rooms = []
    for level in (folder, *folder.parents):
        if not level.is_relative_to(top):
            break
        with contextlib.suppress(OSError, ValueError):  # a root group has no memory.max
            limit = (level / files.limit).read_text().strip()
            if limit != "max" and int(limit) < files.no_limit:
                used = int((level / files.usage).read_text()) - _stat(level, files.inactive_file)
                rooms.append(max(0, int(limit) - max(0, used)))
    return rooms


def _stat(level: Path, key: str) -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in (level / "memory.stat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    return 0


@dataclass(frozen=True, slots=True)
class EngineMemory:
    """What one CPU engine process (all its ranks) takes."""

    weight_bytes: int  # its copy of the weights (the ranks' shards together)
    kv_bytes: int  # one rank's KV pool (cache.kv_cache_gib)
    ranks: int = 1  # processes: tensor_parallel_size on CPU
    # the weights' copies it always keeps (weight_bytes adds those kept where they fit)
    least_weight_bytes: int | None = None

    @property
    def total(self) -> int:
        """The estimate: weights, KV pools and PROCESS_OVERHEAD_BYTES a process."""
        return self.weight_bytes + self.ranks * (self.kv_bytes + PROCESS_OVERHEAD_BYTES)

    @property
    def least_weights(self) -> int:
        """The weights' copies it always keeps."""
        return self.weight_bytes if self.least_weight_bytes is None else self.least_weight_bytes

    @property
    def least(self) -> int:
        """What it cannot run in less than: PROCESS_LEAST_BYTES a process."""
        return self.least_weights + self.ranks * (self.kv_bytes + PROCESS_LEAST_BYTES)


def gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f} GiB"


def check_fits(
    engines: list[EngineMemory], available: int | None, what: str, fix: str
) -> str | None:
    """A ValueError, one line naming the figures and ``fix`` (the settings to lower), when the
    ``engines`` cannot fit in ``available`` even at their least; else a warning line when their
    estimate leaves it less than HEADROOM (or exceeds it), else None. ``what`` names the engines
    (their setting) in the message. Nothing is checked where the available memory is unknown
    (not Linux)."""
    if available is None or not engines:
        return None
    first = engines[0]

    def summary(need: int, process: int, how: str, weights: int) -> str:
        parts = (
            f"each: weights ~{gib(weights)} + KV pool {gib(first.kv_bytes)}"
            f"{f' x {first.ranks} ranks' if first.ranks > 1 else ''} + "
            f"{gib(process) if process >= GIB else f'{process >> 20} MiB'} a process{how}"
        )
        detail = parts if all(e == first for e in engines) else parts.replace("each:", "the first:")
        return f"{what}: {len(engines)} CPU engine(s) need ~{gib(need)} ({detail})"

    least = sum(e.least for e in engines)
    if least > available:
        line = summary(least, PROCESS_LEAST_BYTES, " at the least", first.least_weights)
        raise ValueError(
            f"{line}, more than the {gib(available)} of memory available here (MemAvailable, "
            f"or a cgroup's limit where tighter); lower {fix}"
        )
    need = sum(e.total for e in engines)
    if need > (1 - HEADROOM) * available:
        room = (
            f"more than the {gib(available)} available here"
            if need > available
            else f"of the {gib(available)} available here, leaving under {HEADROOM:.0%}"
        )
        line = summary(need, PROCESS_OVERHEAD_BYTES, " as estimated", first.weight_bytes)
        return f"{line}, {room}: the OOM killer may end one under load; consider lowering {fix}"
    return None
