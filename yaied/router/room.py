"""Whether local CPU engines fit this machine: the pieces the start's check (capacity.py) and the
checks of engines added while serving share, and the latter (``check_room``).

An engine added while the daemon serves (``POST /v1/engines``, a reload's new ``[[engines]]``,
an autoscaler's up) is checked at that moment, with the start's arithmetic
(yaied/core/host_memory.py), against what is left then:

    memory  the new engines' weights + KV pool + a process, with those of the local CPU engines
            still starting or restarting (their memory not taken yet, or given back by a death),
            against MemAvailable or the cgroup's room now, which already holds the running ones
    cores   the serving local CPU engines' and the new ones' (a core a rank, or the threads each
            sets), against the cores this daemon may use, as at the start

A refusal is a NoRoom (one line naming the figures) and starts nothing; a fit that leaves under
10% is a warning line for the caller to log. GPU engines (their memory is the device's), remote
and Ray engines (another machine's) are not counted, as at the start.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from yaied.core.config import EngineConfig
from yaied.core.host_memory import GIB, EngineMemory, available_bytes, check_fits
from yaied.router.config import EngineEntry
from yaied.router.local_process import usable_cores


@dataclass(frozen=True, slots=True)
class CpuEngine:
    name: str
    ranks: int  # processes (tensor-parallel ranks), each with its own KV pool
    threads: int  # torch threads it sets for itself; 0 = a share of the cores

    @property
    def cores(self) -> int:
        """The cores it needs to itself: one a rank, or its threads."""
        return max(self.ranks, self.threads)


# An engine's weights in bytes, (least, expected): the copies always kept refuse, the expected
# ones warn (one int: both); None counts no weights. The CLI's estimate is a function of the
# engine's tensor-parallel ranks (yaied/worker/weight_bytes.py: the router reads no model
# files), since ranks keep float shards whatever the quantization and one process does not; a
# constant (tests) is the same for any ranks.
WeightFigures = int | tuple[int, int] | None
Weights = WeightFigures | Callable[[int], WeightFigures]


@dataclass(frozen=True, slots=True)
class HostRoom:
    """What ``check_room`` reads: the weights' estimate (Weights) and, read anew at each check,
    the memory and the cores; tests inject both."""

    weight_bytes: Weights = None
    available: Callable[[], int | None] = available_bytes
    cores: Callable[[], int] = usable_cores


class NoRoom(ValueError):
    """New local CPU engines that do not fit now; ``resource``: "memory" or "cores"."""

    def __init__(self, resource: str, message: str) -> None:
        super().__init__(message)
        self.resource = resource


def check_room(
    manager: Any,  # the EngineManager (whose pool.py imports this module: typed loosely)
    entries: Mapping[str, EngineEntry],
    what: str,
    fix: str,
    *,
    where: str,
    leaving: Collection[str] = (),
) -> str | None:
    """A NoRoom where the local CPU engines among ``entries`` (name -> entry) do not fit this
    machine now (see the module docstring); else a warning line when they leave under 10% of
    the memory, else None. ``what`` names them and ``fix`` the settings to lower (memory),
    ``where`` the threads setting (cores); ``leaving``: engine ids on their way out (a reload's
    replaced ones), whose cores are not counted."""
    config: EngineConfig | None = manager.engine_config
    if config is None:  # no local engine can be added at all (add_engine says so)
        return None
    new = [cpu for name, e in entries.items() if (cpu := cpu_engine(e, config, name)) is not None]
    if not new:
        return None
    running, pending = _live_cpu_engines(manager, config, leaving)
    room: HostRoom = manager.room
    try:
        check_cores(running + new, room.cores(), where)
    except ValueError as exc:
        raise NoRoom("cores", str(exc)) from None
    if pending:
        what += f" (with {len(pending)} starting or restarting: their memory is not taken yet)"
    memory = memory_of(pending + new, config, room.weight_bytes)
    try:
        return check_fits(memory, room.available(), what, fix)
    except ValueError as exc:
        raise NoRoom("memory", str(exc)) from None


def _live_cpu_engines(
    manager: Any, config: EngineConfig, leaving: Collection[str]
) -> tuple[list[CpuEngine], list[CpuEngine]]:
    """The pool's local CPU engines that stay (not draining or leaving), and those of them that
    hold no memory yet: a process starting, or restarting after its death."""
    running, pending = [], []
    for engine_id, pooled in manager.pool.items():
        if pooled.draining or engine_id in leaving:
            continue
        kind = manager.handles[engine_id].kind
        if kind == "inprocess":  # the daemon's own engine, as the engine config says
            cpu = cpu_engine(EngineEntry(), config, pooled.name)
        elif pooled.entry is not None:
            cpu = cpu_engine(pooled.entry, config, pooled.name)
        else:  # a handle made elsewhere (tests): nothing known of it
            continue
        if cpu is None:
            continue
        running.append(cpu)
        if kind != "inprocess" and manager.engine_state(engine_id) in ("starting", "down"):
            pending.append(cpu)
    return running, pending


def cpu_engine(entry: EngineEntry, engine_config: EngineConfig, name: str) -> CpuEngine | None:
    """The CPU engine ``entry`` starts; None for one on a GPU, remote or Ray."""
    if entry.kind != "local":
        return None
    device = engine_config.device.device if entry.device == "auto" else entry.device
    if engine_device(device) != "cpu":
        return None
    ranks = entry.tensor_parallel_size or len(entry.device_ids)
    ranks = ranks or engine_config.engine.tensor_parallel_size
    return CpuEngine(name, ranks, entry.threads or engine_config.device.threads)


def memory_of(
    engines: list[CpuEngine], engine_config: EngineConfig, weight_bytes: Weights
) -> list[EngineMemory]:
    """What each engine's processes take: its weights at its own ranks ((least, expected)
    bytes: every rank's shard together), and a KV pool a rank."""
    kv = int(engine_config.cache.kv_cache_gib * GIB)
    memory = []
    for engine in engines:
        weights = weight_bytes(engine.ranks) if callable(weight_bytes) else weight_bytes
        weights = weights or 0
        least, expected = (weights, weights) if isinstance(weights, int) else weights
        memory.append(EngineMemory(expected, kv, engine.ranks, least))
    return memory


def check_cores(
    engines: list[CpuEngine], cores: int, where: str, fewer: str = "run fewer engines"
) -> None:
    """A ValueError when more than one CPU engine needs more cores than this daemon may use
    (a core a rank, or the threads each sets): past them they only take turns. The one rule and
    message for CPU engines however given (--engines N, [[engines]], added while serving);
    ``where`` names the threads setting to lower, ``fewer`` how to run fewer engines."""
    need = sum(e.cores for e in engines)
    if len(engines) < 2 or need <= cores:
        return
    each = ", ".join(f"{e.name}: {e.cores}" for e in engines)
    raise ValueError(
        f"{len(engines)} local CPU engines need {need} cores ({each}: a core a rank, or the "
        f"threads each sets), more than the {cores} this daemon may use; lower {where} or "
        f"{fewer}"
    )


# check_cores' settings for the engines of router.engines (--engines) N
ENGINES_FLAG = ("device.threads (--threads)", "router.engines (--engines)")


def engine_device(device: str) -> str:
    """ "cpu" or "cuda": what an engine of ``device`` runs on (auto: CUDA when torch sees it)."""
    if device != "auto":
        return "cpu" if device == "cpu" else "cuda"
    import torch  # deferred: only a device left to auto asks

    return "cuda" if torch.cuda.is_available() else "cpu"
