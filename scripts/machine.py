"""What a benchmark ran on, for its result lines (no torch here: bench_serving reads it before
anything loads torch)."""

from __future__ import annotations

import platform


def cpu_model_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what the platform module knows."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
