"""Tensors for a step on the torch attention path (the CPU path, with or without the C kernels).

The batch is packed into rows: decodes first, then prefill chunks; ``slot_mapping`` says where
each new token's K/V goes, and the attention metadata carries what the path in use reads (the
decode kernel's page table and context lengths, or the torch path's padded decode buckets; each
prefill chunk's pages, and a mask on the torch path). ``TorchBatchPacker.build`` walks the
sequences once, extending flat lists at C speed; one tensor carries them all, and slots and
page tables come out of a few tensor ops over it, whatever the batch size or context length. A
step of a few plain decodes on the kernel path (``FEW_DECODES``) is built in Python outright:
there a dozen small tensor ops cost more than the lists.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from yaied.core.step import ScheduledSeq
from yaied.worker.attention import AttentionMetadata, DecodeBucket, KernelDecodes, PrefillChunk

# Decodes are split into at most this many buckets of at least MIN_DECODE_BUCKET sequences.
MAX_DECODE_BUCKETS = 4
MIN_DECODE_BUCKET = 8
# Up to this many plain decodes are built in Python (build_few_decodes).
FEW_DECODES = 8


class PackedBatch(NamedTuple):
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [num_sampled] int64, rows whose logits are sampled, batch order
    first_row: dict[str, int]  # request id -> the row of its chunk's first token


class TorchBatchPacker:
    def __init__(
        self,
        page_size: int,
        device: torch.device,
        dtype: torch.dtype,
        kv_heads: int,
        decode_kernel,
        prefill_kernel,
        every_token_prefill: bool = False,
        attention_shape: tuple[int, int] | None = None,
    ) -> None:
        self.page_size = page_size
        self.device = device
        self.dtype = dtype
        self.kv_heads = kv_heads
        self.decode_kernel = decode_kernel  # CpuDecodeKernel or None
        self.prefill_kernel = prefill_kernel  # CpuPrefillKernel or None
        # engine.batch_invariant: every sequence runs as a chunk, a decode as a one-token chunk
        # on the prefill path, so that a token's numbers (its K/V too, which the prefix cache
        # hands on) never depend on how its sequence was cut into steps.
        self.every_token_prefill = every_token_prefill
        # (query heads, head dim): with it, chunks too small for a fork-join share one call
        self.attention_shape = attention_shape

    def is_decode(self, seq: ScheduledSeq) -> bool:
        """Whether the sequence runs as a decode row (one token) rather than a chunk."""
        return len(seq.token_ids) == 1 and not self.every_token_prefill

    def build_few_decodes(self, seqs: list[ScheduledSeq]) -> PackedBatch:
        """What ``build`` gives for a step of a few single-token decodes on the decode kernel,
        rows in batch order, from Python lists and one tensor."""
        size = self.page_size
        width = max(len(s.page_ids) for s in seqs)
        ids, positions, slots, lengths, table = [], [], [], [], []
        for seq in seqs:
            pos = seq.start_pos
            ids.append(seq.token_ids[0])
            positions.append(pos)
            slots.append(seq.page_ids[pos // size] * size + pos % size)
            lengths.append(pos + 1)
            table += seq.page_ids
            table += [0] * (width - len(seq.page_ids))
        sample = [i for i, s in enumerate(seqs) if s.sample]
        ids_t, pos_t, slots_t, lengths_t, table_t, sample_t = upload(
            [ids, positions, slots, lengths, table, sample], self.device
        )
        kernel = self.decode_kernel
        decodes = KernelDecodes(
            kernel,
            len(seqs),
            table_t.view(len(seqs), width),
            lengths_t,
            kernel.step,
            output_decodes=all(s.sample and s.num_output_tokens for s in seqs),
        )
        meta = AttentionMetadata(slots_t, [], [], decodes, self.prefill_kernel)
        first_row = {s.request_id: i for i, s in enumerate(seqs)}
        return PackedBatch(ids_t, pos_t, meta, sample_t, first_row)

    def build(self, seqs: list[ScheduledSeq]) -> PackedBatch:
        """Pack the batch into rows: decodes first, sorted by context length so that each decode
        bucket is a contiguous run of rows, then prefill chunks. Sampled rows keep batch order.

        Python walks the sequences once, extending flat lists (ids, positions, page tables, each
        at C speed); one tensor carries them all, and slots and the kernel's page table come out
        of a few tensor ops over it, whatever the batch size or context length."""
        if (
            self.decode_kernel is not None
            and len(seqs) <= FEW_DECODES
            and all(self.is_decode(s) and not s.num_draft_tokens for s in seqs)
        ):
            return self.build_few_decodes(seqs)
        decodes = sorted((s for s in seqs if self.is_decode(s)), key=lambda s: s.start_pos)
        # With the decode kernel, a decode carrying speculative drafts runs as one decode row
        # per position (each attends up to itself, K/V being written first): a prefill chunk
        # over cached context costs a gather and an SDPA call per layer, several times more.
        drafted = [s for s in seqs if s.num_draft_tokens and self.decode_kernel is not None]
        chunks = [s for s in seqs if not self.is_decode(s) and not s.num_draft_tokens] + [
            s for s in seqs if s.num_draft_tokens and self.decode_kernel is None
        ]
        num_kernel_rows = len(decodes) + sum(len(s.token_ids) for s in drafted)
        input_ids: list[int] = []
        positions: list[int] = []
        lengths: list[int] = []  # rows per sequence, in row order
        page_starts: list[int] = []  # where each sequence's page table starts in `pages`
        page_counts: list[int] = []
        pages: list[int] = []
        first_row: dict[str, int] = {}
        for seq in decodes + drafted + chunks:
            n = len(seq.token_ids)
            first_row[seq.request_id] = len(input_ids)
            input_ids += seq.token_ids
            positions += range(seq.start_pos, seq.start_pos + n)
            lengths.append(n)
            page_starts.append(len(pages))
            page_counts.append(len(seq.page_ids))
            pages += seq.page_ids
        sample_rows = [first_row[s.request_id] + len(s.token_ids) - 1 for s in seqs if s.sample]
        ids_t, pos_t, lengths_t, starts_t, counts_t, pages_t, sample_t = upload(
            [input_ids, positions, lengths, page_starts, page_counts, pages, sample_rows],
            torch.device("cpu"),
        )
        size = self.page_size
        num_rows = len(input_ids)
        row_page_start = starts_t.repeat_interleave(lengths_t, output_size=num_rows)
        slots = pages_t[row_page_start + pos_t // size] * size + pos_t % size
        # Chunks that the prefill kernel would run on one thread each (short prompts, such as
        # an embeddings batch's, or engine.batch_invariant's one-token decodes) go to it in one
        # call, a thread a chunk, with the same bits: one Python call and fork-join a step and
        # layer where there was one a chunk, all on the calling thread. The rest a chunk a call.
        prefill_chunks, batched = [], []
        for seq, start in zip(decodes + drafted + chunks, page_starts, strict=True):
            if self.is_decode(seq) or (seq.num_draft_tokens and self.decode_kernel):
                continue
            row = first_row[seq.request_id]
            if self._shares_a_call(seq):
                batched.append([row, len(seq.token_ids), seq.start_pos, start])
            else:
                prefill_chunks.append(self._prefill_chunk(seq, row, pages_t, start))
        batched_chunks = (torch.tensor(batched, dtype=torch.int64), pages_t) if batched else None
        device = self.device
        meta = AttentionMetadata(
            slot_mapping=slots.to(device),
            decode_buckets=[] if self.decode_kernel else self._decode_buckets(decodes),
            prefills=prefill_chunks,
            kernel_decodes=(
                self._kernel_decodes(
                    num_kernel_rows,
                    row_page_start,
                    counts_t.repeat_interleave(lengths_t, output_size=num_rows),
                    pages_t,
                    pos_t,
                    # Decodes and speculative verification rows only, of output positions:
                    # the decode loop may run the step (its rows are the few-row kernel's)
                    not chunks and all(s.sample and s.num_output_tokens for s in seqs),
                )
                if self.decode_kernel
                else None
            ),
            prefill_kernel=self.prefill_kernel,
            batched_chunks=batched_chunks,
        )
        return PackedBatch(ids_t.to(device), pos_t.to(device), meta, sample_t.to(device), first_row)

    def _shares_a_call(self, seq: ScheduledSeq) -> bool:
        kernel, n = self.prefill_kernel, len(seq.token_ids)
        if kernel is None:
            return False
        if self.every_token_prefill and n == 1:
            return True
        shape = self.attention_shape
        return shape is not None and kernel.runs_alone(n, seq.start_pos, *shape)

    def _prefill_chunk(
        self, seq: ScheduledSeq, row: int, pages: torch.Tensor, page_start: int
    ) -> PrefillChunk:
        """pages: every sequence's page table, flat (on the CPU); this one's starts at
        page_start."""
        n, context_len = len(seq.token_ids), seq.start_pos + len(seq.token_ids)
        num_pages = -(-context_len // self.page_size)
        own_pages = pages[page_start : page_start + num_pages]
        if self.prefill_kernel is not None:  # it reads the whole context from the pages
            return PrefillChunk(row, n, own_pages, None, seq.start_pos)
        if seq.start_pos == 0:
            return PrefillChunk(row, n, None, None)
        query_pos = torch.arange(seq.start_pos, context_len, device=self.device)
        key_pos = torch.arange(context_len, device=self.device)
        mask = key_pos[None, :] <= query_pos[:, None]  # [n, context_len] causal, chunk at the end
        return PrefillChunk(row, n, own_pages.to(self.device), mask, seq.start_pos)

    def _kernel_decodes(
        self,
        count: int,
        page_start: torch.Tensor,
        num_pages: torch.Tensor,
        pages: torch.Tensor,
        positions: torch.Tensor,
        output_decodes: bool = False,
    ) -> KernelDecodes | None:
        """The decode kernel's inputs for rows [0, count): page_start, num_pages and positions
        are per row (a drafted sequence's rows share its page table), pages is every page table,
        flat."""
        if not count:
            return None
        width = int(num_pages[:count].max())
        columns = torch.arange(width)
        index = (page_start[:count, None] + columns).clamp_(max=len(pages) - 1)
        table = pages[index].masked_fill_(columns >= num_pages[:count, None], 0)
        return KernelDecodes(
            kernel=self.decode_kernel,
            count=count,
            page_table=table,
            context_lens=positions[:count] + 1,
            step=self.decode_kernel.step,
            output_decodes=output_decodes,
        )

    def _decode_buckets(self, decodes: list[ScheduledSeq]) -> list[DecodeBucket]:
        """Split the (length-sorted) decodes into runs of similar context length, so padding each
        run to its longest costs little."""
        if not decodes:
            return []
        num_buckets = min(MAX_DECODE_BUCKETS, -(-len(decodes) // MIN_DECODE_BUCKET))
        size = -(-len(decodes) // num_buckets)
        return [
            self._decode_bucket(decodes[start : start + size], start)
            for start in range(0, len(decodes), size)
        ]

    def _decode_bucket(self, decodes: list[ScheduledSeq], start: int) -> DecodeBucket:
        lengths = [s.start_pos + 1 for s in decodes]
        max_pages = -(-max(lengths) // self.page_size)
        table = [s.page_ids[:max_pages] + [0] * (max_pages - len(s.page_ids)) for s in decodes]
        positions = torch.arange(max_pages * self.page_size)
        past_end = positions[None, :] >= torch.tensor(lengths)[:, None]
        bias = torch.zeros(past_end.shape, dtype=self.dtype).masked_fill_(past_end, float("-inf"))
        kv_heads = self.kv_heads
        return DecodeBucket(
            start=start,
            count=len(decodes),
            page_table=torch.tensor(table, dtype=torch.int64, device=self.device),
            # [kv_heads * B, 1, max_len]: attention runs over (kv head, sequence) pairs
            bias=bias.repeat(kv_heads, 1).unsqueeze(1).to(self.device),
        )


def upload(lists: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """int64 tensors of ``lists`` on ``device``: on CUDA one pinned, non-blocking copy, so the
    step does not wait for the device here."""
    flat = torch.tensor([v for values in lists for v in values], dtype=torch.int64)
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    return list(flat.split([len(values) for values in lists]))
