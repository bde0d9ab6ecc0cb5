"""CUDA graphs of the decode forward, one per padded batch size.

A decode step of a small model is a few hundred short kernel launches; replaying them as one
graph removes the launch gaps that otherwise dominate at small batch sizes. A graph replays
fixed addresses and shapes, so each batch-size bucket gets its own graph over static input
buffers sized for the largest bucket:

    ids, positions, slots, lens   [max_batch] int32      rows [0, B) used by the bucket-B graph
    page table                    [max_batch, max_pages] int32  (full width: any context length)

A step of n decodes runs the smallest bucket B >= n: the input builder pads rows [n, B) (slot -1,
context length 0: nothing is written, nothing is read), the step's compact inputs are copied
into the static buffers, and the graph replays. Logits and sampling run after the graph, on the
n real rows only. Graphs are captured after the KV pool exists (they bake in its address).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from yaied.kernels.triton_decode import choose_num_splits
from yaied.worker.attention import AttentionMetadata
from yaied.worker.gpu_packing import TritonAttention, TritonStep

log = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 512  # larger decode batches run eagerly: launch overhead is amortised there


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 (padding wastes at most 7 rows), up to max_batch
    (capped at MAX_GRAPH_BATCH), which is always included."""
    top = min(max_batch, MAX_GRAPH_BATCH)
    if top < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes = [s for s in (1, 2, 4) if s < top] + list(range(8, top, 8))
    return sorted(set(sizes + [top]))


def padded_batch_size(sizes: list[int], num_decodes: int) -> int | None:
    """The smallest captured size that holds the batch; None when none does."""
    return next((s for s in sizes if s >= num_decodes), None)


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [batch, hidden] output of the captured forward


class DecodeGraphs:
    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        max_batch: int,
        max_pages: int,
        max_model_len: int,
        num_sms: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = graph_batch_sizes(max_batch)
        self.max_model_len = max_model_len
        self.num_sms = num_sms
        self.kv_heads = kv_caches[0][0].shape[0]
        top = self.sizes[-1]
        self.ids = torch.zeros(top, dtype=torch.int32, device=device)
        self.positions = torch.zeros(top, dtype=torch.int32, device=device)
        self.slots = torch.full((top,), -1, dtype=torch.int32, device=device)
        self.lens = torch.zeros(top, dtype=torch.int32, device=device)
        self.table = torch.zeros(top, max_pages, dtype=torch.int32, device=device)
        self.graphs: dict[int, _Graph] = {}

    def padded_size(self, step_decodes: int, step_tokens: int) -> int | None:
        """The bucket for a decode-only step; None for a step with prefill chunks."""
        if step_tokens != step_decodes:
            return None
        return padded_batch_size(self.sizes, step_decodes)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, into one shared memory pool."""
        started = time.perf_counter()
        pool = None
        for size in reversed(self.sizes):
            meta = self._metadata(size)
            ids, positions = self.ids[:size], self.positions[:size]
            self.model(ids, positions, self.kv_caches, meta)  # compile kernels, warm cuBLAS
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self.model(ids, positions, self.kv_caches, meta)
            pool = graph.pool() if pool is None else pool
            self.graphs[size] = _Graph(graph, hidden)
        torch.cuda.synchronize()
        log.info(
            "captured %d decode graphs (batch %d..%d) in %.1fs",
            len(self.sizes),
            self.sizes[0],
            self.sizes[-1],
            time.perf_counter() - started,
        )

    def _metadata(self, size: int) -> AttentionMetadata:
        # Splits sized for the longest context: each row's split length follows its own length.
        backend = TritonAttention(
            slot_mapping=self.slots[:size],
            num_decodes=size,
            decode_table=self.table[:size],
            decode_lens=self.lens[:size],
            num_splits=choose_num_splits(size, self.kv_heads, self.max_model_len, self.num_sms),
            extend_table=self.table[:0],
            extend_starts=self.lens[:1],
            extend_lens=self.lens[:0],
            max_extend_len=0,
        )
        return AttentionMetadata(self.slots[:size], [], [], backend=backend)

    def run(self, step: TritonStep) -> torch.Tensor:
        """Replay the graph of the step's (already padded) batch size; hidden [size, hidden]."""
        backend = step.meta.backend
        size = backend.num_decodes
        width = backend.decode_table.shape[1]
        self.ids[:size].copy_(step.input_ids)
        self.positions[:size].copy_(step.positions)
        self.slots[:size].copy_(backend.slot_mapping)
        self.lens[:size].copy_(backend.decode_lens)
        self.table[:size, :width].copy_(backend.decode_table)
        entry = self.graphs[size]
        entry.graph.replay()
        return entry.hidden
