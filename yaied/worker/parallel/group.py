"""The ranks of one engine joined by torch.distributed, and the commands rank 0 sends them.

Each engine builds its own process groups over a TCP store it owns, instead of the process-wide
default group of ``init_process_group``: a group lives and dies with its engine, so an engine
rebuilt in the same process, or a test that runs several engines, starts clean. Every wait is
bounded by the group's timeout (``engine.step_timeout_s``): a rank that hangs makes rank 0's
collective raise, a rank that dies makes it raise at once (its sockets close). Either is a
``RankFailure``, which the worker treats as fatal.

Two channels: ``control`` (gloo, host tensors: command headers and the step's inputs) and
``data`` (the model's all-reduces and the logits gather: gloo on CPU, NCCL on CUDA, where they
must stay on the device). On CPU one gloo group serves both.

A step reaches the other ranks as two int64 broadcasts, never a pickled Batch:

    header   [command, arg0, arg1, arg2]
    STEP     payload [num_seqs, (num_tokens, start_pos, num_pages) * num_seqs,
                      token ids..., page ids...]
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from yaied.core.request import SamplingParams
from yaied.core.step import ScheduledSeq

STEP, LOGITS, POOL, GRAPHS, STOP = 1, 2, 3, 4, 5
HEADER_SIZE = 4
# Ranks 1..N-1 wait this long for rank 0's next command: an idle engine is no fault. (A rank 0
# that hangs is the engine's own step timeout to catch; one that dies, the ranks' parent watch.)
IDLE_TIMEOUT = timedelta(days=365)
_GREEDY = SamplingParams()  # other ranks never sample: one shared, unused params object


class RankFailure(RuntimeError):
    """A collective failed or timed out: another rank died or hangs. The engine cannot go on."""


class RankGroup:
    def __init__(self, rank: int, world_size: int, device: torch.device, timeout_s: float) -> None:
        self.rank, self.world_size, self.device = rank, world_size, device
        self.timeout = timedelta(seconds=timeout_s)
        self.control = None
        self.data = None
        # Rank 0: a command was sent whose collectives this rank has not finished; an error
        # now leaves the other ranks waiting in a collective this rank will never reach.
        self.pending = False
        self.comm_seconds = 0.0  # time spent in collectives (rank 0's wait included)
        self.num_collectives = 0

    def connect(self, host: str, port: int) -> None:
        """Join the others (blocks until all have); rank 0 hosts the store."""
        store = dist.TCPStore(
            host,
            port,
            self.world_size,
            self.rank == 0,
            timeout=timedelta(seconds=60),
            wait_for_workers=False,
        )
        self.connect_store(store)

    def connect_store(self, store) -> None:
        control_store = dist.PrefixStore("control", store)
        size = self.world_size
        self.control = dist.ProcessGroupGloo(control_store, self.rank, size, self.timeout)
        if self.device.type != "cuda":
            self.data = self.control
            return
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = self.timeout
        data_store = dist.PrefixStore("data", store)
        self.data = dist.ProcessGroupNCCL(data_store, self.rank, self.world_size, options)

    # -- collectives ------------------------------------------------------------------------

    def _wait(self, work) -> None:
        start = time.perf_counter()
        try:
            work.wait()
        except Exception as exc:
            raise RankFailure(f"tensor-parallel collective failed: {exc}") from exc
        finally:
            self.comm_seconds += time.perf_counter() - start
            self.num_collectives += 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place."""
        self._wait(self.data.allreduce([tensor]))
        return tensor

    def broadcast(
        self, tensor: torch.Tensor, *, control: bool = False, timeout: timedelta | None = None
    ) -> torch.Tensor:
        """Rank 0's tensor into everyone's, in place."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        if timeout is not None:
            options.timeout = timeout
        group = self.control if control else self.data
        self._wait(group.broadcast([tensor], options))
        return tensor

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape everywhere), in rank order, on rank 0; [] on
        the others."""
        options = dist.GatherOptions()
        options.rootRank = 0
        outputs = [[torch.empty_like(tensor) for _ in range(self.world_size)]]
        outputs = outputs if self.rank == 0 else []
        self._wait(self.data.gather(outputs, [tensor.contiguous()], options))
        return outputs[0] if outputs else []

    # -- commands (rank 0 sends, the others receive) ----------------------------------------

    def send(self, command: int, *args: int, payload: torch.Tensor | None = None) -> None:
        header = [command, *args] + [0] * (HEADER_SIZE - 1 - len(args))
        # STEP and LOGITS start collectives that end in the logits gather (ParallelLMHead).
        self.pending = command in (STEP, LOGITS)
        self.broadcast(torch.tensor(header, dtype=torch.int64), control=True)
        if payload is not None:
            self.broadcast(payload, control=True)

    def receive(self) -> list[int]:
        """The next command's header: [command, arg0, arg1, arg2]."""
        header = torch.empty(HEADER_SIZE, dtype=torch.int64)
        return self.broadcast(header, control=True, timeout=IDLE_TIMEOUT).tolist()

    def receive_payload(self, size: int) -> torch.Tensor:
        return self.broadcast(torch.empty(size, dtype=torch.int64), control=True)

    def close(self) -> None:
        self.control = self.data = None  # the process groups close their sockets when freed


def encode_step(seqs: list[ScheduledSeq]) -> torch.Tensor:
    """What the other ranks need of a step to run the same forward (see the module docstring):
    token ids, positions and page tables. Sampling settings stay on rank 0."""
    header = [len(seqs)]
    tokens: list[int] = []
    pages: list[int] = []
    for seq in seqs:
        header += [len(seq.token_ids), seq.start_pos, len(seq.page_ids)]
        tokens += seq.token_ids
        pages += seq.page_ids
    return torch.tensor(header + tokens + pages, dtype=torch.int64)


def decode_step(payload: torch.Tensor) -> list[ScheduledSeq]:
    values = payload.tolist()
    count = values[0]
    sizes = [values[1 + 3 * i : 4 + 3 * i] for i in range(count)]
    cursor = 1 + 3 * count
    seqs = []
    for i, (num_tokens, start_pos, _) in enumerate(sizes):
        tokens = values[cursor : cursor + num_tokens]
        cursor += num_tokens
        seqs.append(ScheduledSeq(str(i), tokens, start_pos, [], False, _GREEDY))
    for seq, (_, _, num_pages) in zip(seqs, sizes, strict=True):
        seq.page_ids = values[cursor : cursor + num_pages]
        cursor += num_pages
    return seqs
