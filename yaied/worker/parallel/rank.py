"""A tensor-parallel rank other than 0: a spawned process that owns its shard of the weights and
of the KV cache and runs whatever rank 0 sends (see leader.py), until rank 0 is gone.

It never decides anything: no scheduler, no sampler. Any error here ends the process, which
rank 0 notices at its next collective (or before its next step) and treats as fatal. torch is
imported only once the thread count is set.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass
from multiprocessing.connection import Connection

from yaied.core.config import EngineConfig
from yaied.core.processes import exit_with_parent, private_progress_lock

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RankSpec:
    rank: int
    world_size: int
    port: int  # rank 0's TCP store, at host
    config: EngineConfig
    device: str  # "cpu" or "cuda:N"
    threads: int  # torch threads on CPU
    cores: tuple[int, ...]  # CPU cores to bind to; () = leave the affinity alone
    host: str = "127.0.0.1"  # where rank 0's store listens (its node, for ranks placed by Ray)


def bind_cpu(threads: int, cores: tuple[int, ...]) -> None:
    """Keep a rank to its share of the cores: its torch threads, and (Linux) the calling
    thread's affinity, which the threads torch starts from it inherit."""
    import torch

    torch.set_num_threads(threads)
    if cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)


def rank_main(spec: RankSpec, conn: Connection) -> None:
    os.environ["OMP_NUM_THREADS"] = str(spec.threads)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C hits the group; rank 0 decides
    logging.basicConfig(level=logging.WARNING, format=f"rank {spec.rank}: %(message)s")
    exit_with_parent("yaied-rank-parent-watch")  # never outlive the parent, even mid-load
    private_progress_lock()  # no semaphore the os._exit below would leave behind
    try:
        follower = Follower(spec)
    except BaseException as exc:
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        conn.close()
        os._exit(1)
    conn.send(("loaded",))
    # systemd signals every process of the service; rank 0's engine decides when ranks go.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        follower.group.connect(spec.host, spec.port)
        follower.serve()
    except BaseException as exc:
        log.error("stopping: %s: %s", type(exc).__name__, exc)
        os._exit(1)
    os._exit(0)  # skip the interpreter's teardown of torch's pools and the group's sockets


class Follower:
    def __init__(self, spec: RankSpec) -> None:
        import torch

        from yaied.worker.gpu_setup import resolve_attention_backend
        from yaied.worker.parallel.group import RankGroup
        from yaied.worker.parallel.loading import load_shard

        self.spec = spec
        self.config = spec.config
        self.device = torch.device(spec.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        else:
            bind_cpu(spec.threads, spec.cores)
        timeout = self.config.engine.step_timeout_s
        self.group = RankGroup(spec.rank, spec.world_size, self.device, timeout)
        self.loaded = load_shard(self.config, spec.rank, self.group, self.device)
        self.backend = resolve_attention_backend(
            self.config.device.attention_backend, self.device.type
        )
        self.kv_caches = None
        self.runner = None

    def serve(self) -> None:
        import torch

        from yaied.worker.parallel.group import GRAPHS, LOGITS, POOL, STEP, STOP, decode_step
        from yaied.worker.runner_setup import (
            allocate_kv,
            build_runner,
            capture_graphs,
            resolve_kv_dtype,
        )

        model, hidden_size = self.loaded.model, self.loaded.model.shape.hidden_size
        with torch.inference_mode():
            while True:
                command, arg, _, _ = self.group.receive()
                if command == STEP:
                    seqs = decode_step(self.group.receive_payload(arg))
                    self.runner._forward(seqs)  # the same forward as rank 0's runner
                elif command == LOGITS:
                    hidden = torch.empty(
                        (arg, hidden_size), dtype=self.loaded.dtype, device=self.device
                    )
                    model.lm_head.follow(self.group.broadcast(hidden))
                elif command == POOL:
                    self.runner = self.kv_caches = None  # a warm-up pool is freed first
                    page_size = self.config.cache.page_size
                    dtype = self.loaded.dtype
                    kv_dtype = resolve_kv_dtype(
                        self.config.cache.kv_cache_dtype,
                        dtype,
                        self.device,
                        self.backend,
                        self.loaded.weight_dtype,
                    )
                    self.kv_caches = allocate_kv(model, arg, page_size, kv_dtype, self.device)
                    self.runner = build_runner(
                        model, self.kv_caches, self.config, self.device, self.backend, dtype=dtype
                    )
                elif command == GRAPHS:
                    self.runner.graphs = capture_graphs(
                        model, self.kv_caches, self.config, arg, self.device
                    )
                elif command == STOP:
                    return
                else:
                    raise RuntimeError(f"unknown command {command}")
