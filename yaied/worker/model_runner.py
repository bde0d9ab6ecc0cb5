"""Turns a Batch into tensors, runs the model, samples: one forward and one host copy a step."""

from __future__ import annotations

import time

import torch
from torch import nn

from yaied.engine.scheduler import Batch, ScheduledSeq, StepOutput
from yaied.worker.attention import AttentionMetadata, DecodeBucket, PrefillChunk
from yaied.worker.sampler import SamplingTensors, sample

# Decodes are split into at most this many buckets of at least MIN_DECODE_BUCKET sequences.
MAX_DECODE_BUCKETS = 4
MIN_DECODE_BUCKET = 8


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        page_size: int,
        vocab_size: int,
        device: torch.device,
        seed: int = 0,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.page_size = page_size
        self.vocab_size = vocab_size
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    @torch.inference_mode()
    def execute(self, batch: Batch) -> StepOutput:
        start = time.perf_counter()
        input_ids, positions, meta, sample_rows = self._prepare(batch.seqs)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        logits = self.model.compute_logits(hidden[sample_rows])
        params = [seq.params for seq in batch.seqs if seq.sample]
        tensors = SamplingTensors.build(params, self.vocab_size, self.device)
        token_ids = sample(logits, tensors, self.generator).tolist()  # the step's one host sync
        return StepOutput(token_ids, model_time=time.perf_counter() - start)

    def _slots(self, page_ids: list[int], start: int, end: int) -> torch.Tensor:
        """KV slots of positions [start, end) of a sequence with the given page table."""
        positions = torch.arange(start, end)
        pages = torch.tensor(page_ids, dtype=torch.int64)
        return pages[positions // self.page_size] * self.page_size + positions % self.page_size

    def _prepare(self, seqs: list[ScheduledSeq]):
        input_ids: list[int] = []
        positions: list[int] = []
        slot_parts: list[torch.Tensor] = []
        sample_rows: list[int] = []
        decodes: list[ScheduledSeq] = []
        decode_rows: list[int] = []
        prefill_chunks: list[PrefillChunk] = []
        for seq in seqs:
            n = len(seq.token_ids)
            row = len(input_ids)
            input_ids += seq.token_ids
            positions += range(seq.start_pos, seq.start_pos + n)
            slot_parts.append(self._slots(seq.page_ids, seq.start_pos, seq.start_pos + n))
            if seq.sample:
                sample_rows.append(row + n - 1)
            if n == 1:
                decodes.append(seq)
                decode_rows.append(row)
            else:
                prefill_chunks.append(self._prefill_chunk(seq, row))
        device = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slot_parts).to(device),
            decode_buckets=self._decode_buckets(decodes, decode_rows),
            prefills=prefill_chunks,
        )
        return (
            torch.tensor(input_ids, dtype=torch.int64, device=device),
            torch.tensor(positions, dtype=torch.int64, device=device),
            meta,
            torch.tensor(sample_rows, dtype=torch.int64, device=device),
        )

    def _prefill_chunk(self, seq: ScheduledSeq, row: int) -> PrefillChunk:
        n, context_len = len(seq.token_ids), seq.start_pos + len(seq.token_ids)
        if seq.start_pos == 0:
            return PrefillChunk(row, n, None, None)
        num_pages = -(-context_len // self.page_size)
        pages = torch.tensor(seq.page_ids[:num_pages], dtype=torch.int64, device=self.device)
        query_pos = torch.arange(seq.start_pos, context_len, device=self.device)
        key_pos = torch.arange(context_len, device=self.device)
        mask = key_pos[None, :] <= query_pos[:, None]  # [n, context_len] causal, chunk at the end
        return PrefillChunk(row, n, pages, mask)

    def _decode_buckets(self, decodes: list[ScheduledSeq], rows: list[int]) -> list[DecodeBucket]:
        """Group decodes of similar context length, so padding to the longest costs little."""
        if not decodes:
            return []
        order = sorted(range(len(decodes)), key=lambda i: decodes[i].start_pos)
        num_buckets = min(MAX_DECODE_BUCKETS, -(-len(order) // MIN_DECODE_BUCKET))
        size = -(-len(order) // num_buckets)
        return [
            self._decode_bucket([decodes[i] for i in part], [rows[i] for i in part])
            for part in (order[j : j + size] for j in range(0, len(order), size))
        ]

    def _decode_bucket(self, decodes: list[ScheduledSeq], rows: list[int]) -> DecodeBucket:
        lengths = [s.start_pos + 1 for s in decodes]
        max_pages = -(-max(lengths) // self.page_size)
        table = torch.tensor(
            [
                s.page_ids[:max_pages] + [0] * (max_pages - len(s.page_ids[:max_pages]))
                for s in decodes
            ],
            dtype=torch.int64,
        )
        positions = torch.arange(max_pages * self.page_size)
        past_end = positions[None, :] >= torch.tensor(lengths)[:, None]
        bias = torch.zeros(past_end.shape).masked_fill_(past_end, float("-inf"))
        device = self.device
        return DecodeBucket(
            rows=torch.tensor(rows, dtype=torch.int64, device=device),
            page_table=table.to(device),
            bias=bias[:, None, :].to(device),
        )
