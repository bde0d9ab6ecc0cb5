"""Building the daemon's engine manager from its config: which engines, on which devices."""

from __future__ import annotations

from yaied.core.config import EngineConfig
from yaied.router.config import EngineEntry, RouterConfig
from yaied.router.local_process import usable_cores
from yaied.router.manager import EngineManager
from yaied.router.names import entry_names
from yaied.router.room import ENGINES_FLAG, CpuEngine, check_cores


def build_manager(
    engine_config: EngineConfig, router_config: RouterConfig, entries: tuple[EngineEntry, ...]
) -> EngineManager:
    """The daemon's engines: the `[[engines]]` entries, else ``router.engines`` local ones (one
    per GPU when there are that many GPUs, else CPU processes). Nothing starts here."""
    manager = EngineManager(router_config, engine_config=engine_config)
    if not entries:
        size, threads = engine_config.engine.tensor_parallel_size, engine_config.device.threads
        device = engine_config.device.device
        entries = local_entries(router_config.engines, device, size, threads)
    for entry, name in zip(entries, entry_names(entries), strict=True):
        manager.add_engine(entry, name=name)
    return manager


def local_entries(
    count: int, device: str, tensor_parallel_size: int = 1, threads: int = 0
) -> tuple[EngineEntry, ...]:
    """``count`` engines of ``tensor_parallel_size`` GPUs each (engine i on cuda:i*N ..), when
    there are that many GPUs, else CPU processes of ``threads`` (device.threads) each."""
    if device in ("auto", "cuda"):
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        size = tensor_parallel_size
        if gpus >= count * size:
            return tuple(EngineEntry(device=f"cuda:{i * size}") for i in range(count))
        if device == "cuda":
            raise ValueError(
                f"router.engines = {count} of tensor_parallel_size {size} asks for more GPUs "
                f"than the {gpus} here"
            )
        device = "cpu"
    if device == "cpu":
        check_cpu_engines(count, tensor_parallel_size, threads)
    return tuple(EngineEntry(device=device) for _ in range(count))


def check_cpu_engines(count: int, tensor_parallel_size: int = 1, threads: int = 0) -> None:
    """A ValueError (room.py's check_cores: one rule and message for CPU engines however they
    are given) unless ``count`` CPU engines of ``tensor_parallel_size`` ranks and ``threads``
    each (device.threads) fit the cores this daemon may use. --engines had no bound: 64 engines
    on 2 cores spawned 64 processes, each loading torch and the model and holding its own KV
    pool, taking turns on the cores: more memory than one engine, and no more throughput. One
    engine runs on what it is given."""
    names = entry_names([EngineEntry(device="cpu")] * count)
    engines = [CpuEngine(name, tensor_parallel_size, threads) for name in names]
    check_cores(engines, usable_cores(), *ENGINES_FLAG)
