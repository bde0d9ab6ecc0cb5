"""Whether the local CPU engines a start asks for fit this machine: its cores and its memory.

Checked by the CLI before any engine loads and before the daemon listens, so that a setting the
machine cannot hold is one line and exit status 2 (a setting to fix, which systemd does not
retry), not engines that take turns on the cores or an OOM killer ending one mid-serve, which
the supervisor restarts into the same end.

    cores   with more than one CPU engine, each needs a core a rank, or its threads where it
            sets them (an entry's ``threads``, else ``device.threads``): past the cores they
            only take turns (room.py's check_cores, for --engines N as for [[engines]]).
    memory  weights + KV pool + a process's overhead, summed over the engines
            (yaied/core/host_memory.py), against MemAvailable or the cgroup's room; a start
            leaving under 10% of it is a warning.

The autoscaler's ``max_engines`` is a ceiling, not a count to start: where its CPU engines
would not fit as estimated, it is lowered to what does, with a warning (the autoscaler then
stops adding there), and only a ``min_engines`` that cannot fit even at its least is refused.
GPU engines (their memory is the device's) and remote or Ray engines (another machine's) are out
of scope here. Engines added while the daemon serves are checked against what is left then, with
the same pieces (room.py).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from yaied.core.config import EngineConfig
from yaied.core.host_memory import EngineMemory, available_bytes, check_fits, gib
from yaied.router.autoscale import AutoscaleConfig
from yaied.router.build import local_entries
from yaied.router.config import EngineEntry, RouterConfig
from yaied.router.local_process import usable_cores
from yaied.router.names import entry_names
from yaied.router.room import (
    ENGINES_FLAG,
    CpuEngine,
    Weights,
    check_cores,
    cpu_engine,
    engine_device,
    memory_of,
)

log = logging.getLogger(__name__)


def check_capacity(
    engine_config: EngineConfig,
    router: RouterConfig,
    entries: tuple[EngineEntry, ...],
    autoscale: AutoscaleConfig | None,
    weight_bytes: Weights,
    *,
    cores: int | None = None,
    available: int | None = -1,
) -> AutoscaleConfig | None:
    """A ValueError (one line) where the start's CPU engines do not fit this machine's cores or
    memory; else ``autoscale`` with its max_engines lowered to what fits (logged). ``cores``,
    ``available``: the machine's, found when not given (tests inject them; None: not known);
    ``weight_bytes``: an engine's weights at its ranks (room.py's Weights)."""
    cores = usable_cores() if cores is None else cores
    available = available_bytes() if available == -1 else available
    cpu, num_local = cpu_engines(engine_config, router, entries)
    settings = ("engines.threads", "run fewer engines") if entries else ENGINES_FLAG
    check_cores(cpu, cores, *settings)
    memory = memory_of(cpu, engine_config, weight_bytes)
    if entries:
        what, fix = "[[engines]]", "cache.kv_cache_gib (--kv-cache-gib) or the local entries"
    elif router.engines > 1:
        what = f"router.engines (--engines) = {router.engines}"
        fix = "cache.kv_cache_gib (--kv-cache-gib) or router.engines (--engines)"
    else:
        what, fix = "the engine", "cache.kv_cache_gib (--kv-cache-gib)"
    fix += ", or the weights' size (model.quantization, --quantization)"
    warning = check_fits(memory, available, what, fix)
    new = _autoscaled_engine(engine_config, autoscale)
    if autoscale is not None and new is not None:
        one = memory_of([new], engine_config, weight_bytes)[0]
        autoscale, memory = _bound_autoscale(
            autoscale, new, cpu, memory, num_local, cores, available, one
        )
        warning = check_fits(memory, available, f"{what} and the autoscaler's", fix) or warning
    if warning:
        log.warning("%s", warning)
    return autoscale


def cpu_engines(
    engine_config: EngineConfig, router: RouterConfig, entries: tuple[EngineEntry, ...]
) -> tuple[list[CpuEngine], int]:
    """The start's local engines on CPU, and how many local engines (any device) it has."""
    size = engine_config.engine.tensor_parallel_size
    default_threads = engine_config.device.threads
    if not entries:
        if router.engines == 1:  # the daemon's own process runs it
            if engine_device(engine_config.device.device) != "cpu":
                return [], 1
            return [CpuEngine("0", size, default_threads)], 1
        # Refuses more than the cores, as check_cores below would (the same rule and line).
        entries = local_entries(router.engines, engine_config.device.device, size, default_threads)
    local = [e for e in entries if e.kind == "local"]
    named = zip(entries, entry_names(entries), strict=True)
    found = [cpu for e, name in named if (cpu := cpu_engine(e, engine_config, name)) is not None]
    return found, len(local)


def _bound_autoscale(
    autoscale: AutoscaleConfig,
    new: CpuEngine,
    cpu: list[CpuEngine],
    memory: list[EngineMemory],
    num_local: int,
    cores: int,
    available: int | None,
    one: EngineMemory,
) -> tuple[AutoscaleConfig, list[EngineMemory]]:
    """``autoscale`` with max_engines lowered to the CPU engines that fit as estimated (``one``:
    the memory of one it adds), and the memory of the engines at its ceiling. A min_engines
    refused only where they cannot fit even at their least (host_memory.py), as check_fits does:
    past the estimate max_engines stays at min_engines, and check_fits warns."""
    extra = autoscale.max_engines - num_local
    if extra <= 0:
        return autoscale, memory
    # One engine alone runs on what it is given; beside others, each needs its own cores.
    by_cores = max((cores - sum(e.cores for e in cpu)) // new.cores, 0 if cpu else 1)

    def fitting(size: Callable[[EngineMemory], int]) -> int:
        room = extra if available is None else (available - sum(map(size, memory))) // size(one)
        return max(0, min(extra, by_cores, room))

    fit = fitting(lambda m: m.total)
    if fit < extra:
        at_least = num_local + fitting(lambda m: m.least)
        least = max(autoscale.min_engines, 1)
        if at_least < least:
            raise ValueError(
                f"autoscale.min_engines = {autoscale.min_engines} local engines do not fit here "
                f"(at most {at_least}: {_why(cores, new, available, one.least, ' at the least')});"
                " lower autoscale.min_engines or cache.kv_cache_gib"
            )
        most = max(num_local + fit, least)
        log.warning(
            "autoscale.max_engines lowered from %d to %d local engines: what fits %s",
            autoscale.max_engines,
            most,
            _why(cores, new, available, one.total, ""),
        )
        autoscale = dataclasses.replace(autoscale, max_engines=most)
        fit = most - num_local
    return autoscale, memory + [one] * fit


def _why(cores: int, new: CpuEngine, available: int | None, each: int, how: str) -> str:
    """The figures a bound on the autoscaler's engines comes from (memory: where known)."""
    why = f"{cores} cores (each new engine needs {new.cores})"
    if available is None:
        return why
    return f"{why}; {gib(available)} of memory, ~{gib(each)} a new engine{how}"


def _autoscaled_engine(
    engine_config: EngineConfig, autoscale: AutoscaleConfig | None
) -> CpuEngine | None:
    """The CPU engine the autoscaler would add; None where it adds none here, or not on CPU."""
    if autoscale is None or not autoscale.enabled:
        return None
    return cpu_engine(autoscale.new_entry(), engine_config, "autoscaled")
