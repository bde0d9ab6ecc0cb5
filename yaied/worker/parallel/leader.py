"""Rank 0's side of tensor parallelism: it spawns the other ranks, waits for their shards, and
tells them what to run; the scheduler, the prefix cache and sampling stay here, once.

    rank 0 (the worker thread)                 ranks 1..N-1 (spawned processes, rank.py)
    runner._forward(seqs) -- STEP + payload -->  runner._forward(seqs)     same forward,
       all-reduces in every layer  <-------->     all-reduces                own heads
    compute_logits(rows)  -- LOGITS + rows --->  lm_head.follow(rows)
       gather on rank 0   <-----------------     its logits columns
    sample, StepOutput
    _runner(pool)         -- POOL(pages) ---->  allocate the same pool, build a runner
    capture graphs        -- GRAPHS(len) ---->  capture the same graphs (collectives inside)

A rank that dies or hangs makes rank 0's next collective raise (RankFailure); the worker
reports the step fatal, the engine dies and is restarted like any dead engine. The ranks exit
when rank 0's process does (they watch its sentinel) and are killed by ``close``.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from yaied.core.config import EngineConfig
from yaied.core.processes import describe_exit
from yaied.core.step import ScheduledSeq
from yaied.worker.loader import LoadedModel
from yaied.worker.model_runner import ModelRunner
from yaied.worker.parallel.group import GRAPHS, POOL, STEP, RankFailure, RankGroup, encode_step
from yaied.worker.parallel.loading import load_shard, resolve_shape
from yaied.worker.parallel.rank import RankSpec, bind_cpu, rank_main

log = logging.getLogger(__name__)


class LeaderRunner(ModelRunner):
    """Rank 0's runner: every forward is announced to the other ranks first, whoever calls it
    (a step, a step rerun one sequence at a time, the GPU warm-up)."""

    parallel: TensorParallel

    def _forward(self, seqs: list[ScheduledSeq], inputs: torch.Tensor | None = None):
        # The other ranks get token ids from the host: no step is scheduled ahead here
        # (engine.overlap_steps is off with tensor parallelism).
        assert inputs is None, "tensor parallelism takes no step scheduled ahead"
        self.parallel.send_step(seqs)
        return super()._forward(seqs)


def rank_devices(device: torch.device, world_size: int) -> list[str]:
    """cuda:K..K+N-1 from cuda:K (the devices a router's engine process sees are renumbered
    from 0 by CUDA_VISIBLE_DEVICES); every rank on the CPU otherwise."""
    if device.type == "cuda":
        first = device.index or 0
        return [f"cuda:{first + rank}" for rank in range(world_size)]
    return ["cpu"] * world_size


def core_shares(world_size: int, threads: int) -> list[tuple[int, tuple[int, ...]]]:
    """Per rank on CPU: (torch threads, the cores to bind to). The cores this process may use
    are cut into N contiguous runs; with fewer cores than ranks, every rank gets them all."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    per_rank = max(1, (threads or len(cores) or os.cpu_count() or 1) // world_size)
    if len(cores) < world_size:
        return [(per_rank, tuple(cores))] * world_size
    size = len(cores) // world_size
    return [(per_rank, tuple(cores[r * size : (r + 1) * size])) for r in range(world_size)]


def _allow_children() -> None:
    """A router's engine process is daemonic (the router's exit ends it), and multiprocessing
    refuses a daemonic process children lest they be orphaned. Ranks never are: each exits when
    this process does (it watches its sentinel), and ``close`` kills them. The flag only
    matters to this process's own exit, which never waits for the ranks anyway."""
    process = multiprocessing.current_process()
    if process.daemon:
        process.daemon = False


class Rank(Protocol):
    """A started rank 1..N-1, as rank 0 sees it: a spawned process here (``ProcessRank``), or
    whatever a ``RankLauncher`` made (a Ray actor on another node: worker/parallel/ray_ranks.py)."""

    name: str
    pid: int | None

    def wait_loaded(self) -> None:
        """Block until the rank has loaded its shard; RuntimeError naming why it did not."""

    def exit_reason(self) -> str | None:
        """Why the rank is gone (checked before each step), or None while it runs."""

    def kill(self) -> None:
        """Stop the rank now and reap it; safe twice."""


class RankLauncher(Protocol):
    """Starts ranks elsewhere than as processes of this one. ``host`` is the address the
    ranks reach rank 0's store at; ``cores`` False: each rank keeps the cores of its own
    machine (rank 0's affinity means nothing there)."""

    host: str
    cores: bool

    def __call__(self, spec: RankSpec) -> Rank: ...


@dataclass(slots=True)
class ProcessRank:
    """A rank spawned as a process of this one, reporting over a pipe."""

    process: multiprocessing.process.BaseProcess
    conn: multiprocessing.connection.Connection

    @property
    def name(self) -> str:
        return self.process.name

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def wait_loaded(self) -> None:
        multiprocessing.connection.wait([self.conn, self.process.sentinel])
        message = ("failed", describe_exit(self.process.exitcode))
        if self.conn.poll():
            with contextlib.suppress(EOFError):
                message = self.conn.recv()
        if message[0] != "loaded":
            raise RuntimeError(f"tensor-parallel {self.name}: {message[1]}")

    def exit_reason(self) -> str | None:
        if self.process.is_alive():
            return None
        return f"tensor-parallel {self.name} {describe_exit(self.process.exitcode)}"

    def kill(self) -> None:
        with contextlib.suppress(Exception):
            if self.process.is_alive():
                self.process.kill()
        with contextlib.suppress(Exception):
            self.process.join(5)
            self.conn.close()


def spawn_rank(spec: RankSpec) -> ProcessRank:
    """Rank ``spec.rank`` as a process of this one (multiprocessing spawn)."""
    _allow_children()
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe(duplex=False)
    process = ctx.Process(
        target=rank_main, args=(spec, theirs), name=f"yaied-rank-{spec.rank}", daemon=True
    )
    process.start()
    theirs.close()
    return ProcessRank(process, ours)


class TensorParallel:
    def __init__(self, group: RankGroup, ranks: list[Rank]) -> None:
        self.group = group
        self.ranks = ranks

    @classmethod
    def start(
        cls, config: EngineConfig, device: torch.device, launcher: RankLauncher | None = None
    ) -> tuple[TensorParallel, LoadedModel]:
        """Start ranks 1..N-1 (spawned here, or by ``launcher``), load rank 0's shard
        meanwhile, then join them all."""
        world_size = config.engine.tensor_parallel_size
        resolve_shape(config)  # refuse an unsplittable model before spawning anything
        group = RankGroup(0, world_size, device, config.engine.step_timeout_s)
        # The store listens on every interface; ranks elsewhere reach it at launcher.host.
        host = "127.0.0.1" if launcher is None else launcher.host
        store = dist.TCPStore(host, 0, world_size, True, wait_for_workers=False)
        shares = core_shares(world_size, config.device.threads)
        if launcher is not None and not launcher.cores:
            shares = [(threads, ()) for threads, _ in shares]
        if device.type == "cpu":
            bind_cpu(*shares[0])  # the worker thread: this is the thread every step runs in
        devices = rank_devices(device, world_size)
        start_rank = launcher or spawn_rank
        ranks: list[Rank] = []
        parallel = cls(group, ranks)
        try:
            for rank in range(1, world_size):
                spec = RankSpec(
                    rank, world_size, store.port, config, devices[rank], *shares[rank], host=host
                )
                ranks.append(start_rank(spec))
            loaded = load_shard(config, 0, group, device)
            for started in ranks:  # they load side by side
                started.wait_loaded()
            group.connect_store(store)
        except BaseException:
            parallel.close()
            raise
        log.info("tensor parallel: %d ranks on %s", world_size, ", ".join(devices))
        return parallel, loaded

    def send_step(self, seqs: list[ScheduledSeq]) -> None:
        payload = encode_step(seqs)
        self.group.send(STEP, payload.numel(), payload=payload)

    def send_pool(self, num_pages: int) -> None:
        self.group.send(POOL, num_pages)

    def send_graphs(self, max_len: int) -> None:
        self.group.send(GRAPHS, max_len)

    def check_ranks(self) -> None:
        """Before each step: a rank that died fails the step at once (fatal), without waiting
        for a collective to notice."""
        for rank in self.ranks:
            if (reason := rank.exit_reason()) is not None:
                raise RankFailure(reason)

    @property
    def pids(self) -> list[int]:
        return [r.pid for r in self.ranks if r.pid is not None]

    def close(self) -> None:
        """Kill the ranks (they hold nothing worth a goodbye) and reap them. Safe from any
        thread, twice, and while the worker thread waits in a collective (it then raises)."""
        for rank in self.ranks:
            rank.kill()
