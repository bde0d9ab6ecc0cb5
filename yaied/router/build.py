"""Building the daemon's engine manager from its config: which engines, on which devices."""

from __future__ import annotations

from yaied.core.config import EngineConfig
from yaied.router.config import EngineEntry, RouterConfig
from yaied.router.local_process import usable_cores
from yaied.router.manager import EngineManager
from yaied.router.names import entry_names


def build_manager(
    engine_config: EngineConfig, router_config: RouterConfig, entries: tuple[EngineEntry, ...]
) -> EngineManager:
    """The daemon's engines: the `[[engines]]` entries, else ``router.engines`` local ones (one
    per GPU when there are that many GPUs, else CPU processes). Nothing starts here."""
    manager = EngineManager(router_config, engine_config=engine_config)
    if not entries:
        size = engine_config.engine.tensor_parallel_size
        entries = local_entries(router_config.engines, engine_config.device.device, size)
    for entry, name in zip(entries, entry_names(entries), strict=True):
        manager.add_engine(entry, name=name)
    return manager


def local_entries(
    count: int, device: str, tensor_parallel_size: int = 1
) -> tuple[EngineEntry, ...]:
    """``count`` engines of ``tensor_parallel_size`` GPUs each (engine i on cuda:i*N ..), when
    there are that many GPUs, else CPU processes."""
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
        check_cpu_engines(count, tensor_parallel_size)
    return tuple(EngineEntry(device=device) for _ in range(count))


def check_cpu_engines(count: int, tensor_parallel_size: int = 1) -> None:
    """A ValueError unless each of ``count`` CPU engines' processes (ranks) gets a core of its
    own. --engines had no bound: 64 engines on 2 cores spawned 64 processes, each loading torch
    and the model and holding its own KV pool, one thread each, taking turns on the cores: more
    memory than one engine, and no more throughput. One engine runs on what it is given."""
    cores = usable_cores()
    if count > 1 and count * tensor_parallel_size > cores:
        ranks = "" if tensor_parallel_size == 1 else f" of {tensor_parallel_size} ranks each"
        most = max(1, cores // tensor_parallel_size)
        raise ValueError(
            f"router.engines (--engines) must be at most {most} here, got {count}: CPU engine "
            f"processes{ranks} need a core each, and this daemon may use {cores}"
        )
