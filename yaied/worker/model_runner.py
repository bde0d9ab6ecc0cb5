"""Turns a Batch into tensors, runs the model, samples: one forward and one host copy a step."""

from __future__ import annotations

import time

import torch
from torch import nn

from yaied.engine.scheduler import Batch, ScheduledSeq, StepOutput
from yaied.worker.attention import AttentionMetadata, PrefillChunk
from yaied.worker.sampler import SamplingTensors, sample


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
        self._offsets = torch.arange(page_size, device=device)

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
        pages = torch.tensor(page_ids, dtype=torch.int64)
        slots = (pages[:, None] * self.page_size + self._offsets.cpu()[None, :]).view(-1)
        return slots[start:end]

    def _prepare(self, seqs: list[ScheduledSeq]):
        input_ids: list[int] = []
        positions: list[int] = []
        slot_parts: list[torch.Tensor] = []
        sample_rows: list[int] = []
        decodes = [s for s in seqs if len(s.token_ids) == 1]
        prefill_chunks: list[PrefillChunk] = []
        for seq in seqs:
            n = len(seq.token_ids)
            row = len(input_ids)
            input_ids += seq.token_ids
            positions += range(seq.start_pos, seq.start_pos + n)
            slot_parts.append(self._slots(seq.page_ids, seq.start_pos, seq.start_pos + n))
            if seq.sample:
                sample_rows.append(row + n - 1)
            if n > 1:
                prefill_chunks.append(self._prefill_chunk(seq, row))
        device = self.device
        decode_slots = decode_mask = None
        if decodes:
            decode_slots, decode_mask = self._decode_index(decodes)
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slot_parts).to(device),
            num_decodes=len(decodes),
            decode_slots=decode_slots,
            decode_mask=decode_mask,
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
            return PrefillChunk(row, n, context_len, None, None)
        slots = self._slots(seq.page_ids, 0, context_len).to(self.device)
        query_pos = torch.arange(seq.start_pos, context_len, device=self.device)
        key_pos = torch.arange(context_len, device=self.device)
        mask = key_pos[None, :] <= query_pos[:, None]  # [n, context_len] causal, chunk at the end
        return PrefillChunk(row, n, context_len, slots, mask)

    def _decode_index(self, decodes: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor]:
        """Padded slot index [B, max_len] and mask [B, 1, 1, max_len] over each context."""
        lengths = torch.tensor([s.start_pos + 1 for s in decodes], dtype=torch.int64)
        max_pages = max(len(s.page_ids) for s in decodes)
        table = torch.zeros(len(decodes), max_pages, dtype=torch.int64)
        for i, s in enumerate(decodes):
            table[i, : len(s.page_ids)] = torch.tensor(s.page_ids, dtype=torch.int64)
        max_len = int(lengths.max())
        slots = (table[:, :, None] * self.page_size + self._offsets.cpu()).view(len(decodes), -1)
        slots = slots[:, :max_len]
        mask = torch.arange(max_len)[None, :] < lengths[:, None]
        return slots.to(self.device), mask[:, None, None, :].to(self.device)
