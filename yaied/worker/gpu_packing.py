"""Tensors for a step on the Triton attention path (the CUDA path; on CPU it runs in Triton's
interpreter, which is how the tests drive it).

Every index array of a step (token ids, positions, slots, sampled rows, the decode and extend
page tables and lengths) is written into one int32 host buffer, pinned on a GPU, and reaches the
device in one non-blocking copy; the step's only host sync is the copy of the sampled ids back.
The buffers are reused, so before rewriting the host buffer the previous copy's event is waited
on: a step need not end with a sync (copying an empty tensor back does not sync, as when a step
is all mid-prompt chunks that sample nothing, and a failed step stops before its copy), and its
copy may then still be queued behind earlier work when the next step is built.

Row layout of a step, as on the torch path:

    rows [0, num_decodes)                    one token per decoding sequence (batch order)
    rows [num_decodes, num_decodes + pad)    padding up to a CUDA graph's batch size:
                                             slot -1 (no K/V written), context length 0
    rows [num_decodes + pad, num_tokens)     prefill chunks, one after another
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch

from yaied.core.step import ScheduledSeq
from yaied.kernels.triton_decode import choose_num_splits, paged_decode_attention
from yaied.kernels.triton_extend import extend_attention
from yaied.kernels.triton_store_kv import store_kv
from yaied.worker.attention import AttentionMetadata


@dataclass(slots=True)
class TritonAttention:
    """The attention backend of one step: stores new K/V and attends with the Triton kernels."""

    slot_mapping: torch.Tensor  # [num_tokens] int32, -1 for padding rows
    num_decodes: int  # rows [0, num_decodes) decode, padding included
    decode_table: torch.Tensor  # [num_decodes, width] int32
    decode_lens: torch.Tensor  # [num_decodes] int32, 0 for padding rows
    num_splits: int
    extend_table: torch.Tensor  # [num_chunks, width] int32
    extend_starts: torch.Tensor  # [num_chunks + 1] int32, rows relative to num_decodes
    extend_lens: torch.Tensor  # [num_chunks] int32: context length after each chunk
    max_extend_len: int  # the longest chunk (sizes the extend grid on the host)

    def store(self, k_cache, v_cache, k: torch.Tensor, v: torch.Tensor) -> None:
        store_kv(k, v, k_cache, v_cache, self.slot_mapping)

    def attend(self, q: torch.Tensor, k_cache, v_cache, scale: float) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]
        out = torch.empty_like(q)
        n = self.num_decodes
        if n:
            paged_decode_attention(
                q[:n], k_cache, v_cache, self.decode_table, self.decode_lens, scale,
                self.num_splits, out=out[:n],
            )  # fmt: skip
        if self.max_extend_len:
            extend_attention(
                q[n:], k_cache, v_cache, self.extend_table, self.extend_starts, self.extend_lens,
                self.max_extend_len, scale, out=out[n:],
            )  # fmt: skip
        return out


_ALIGN = 4  # int32 entries in 16 bytes
_ALIGN_PAD = array("i", [0] * _ALIGN)


class HostStaging:
    """One int32 host buffer (pinned on a GPU) and its device twin, grown on demand."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pin = device.type == "cuda"
        self.asynchronous = self.pin  # copies out of `host` may still be pending after upload
        self.host = torch.empty(0, dtype=torch.int32)
        self.dev = torch.empty(0, dtype=torch.int32, device=device)
        self.copied = None  # event recorded after the last copy out of `host` (pinned only)

    def _record(self):
        event = torch.cuda.Event()
        event.record()
        return event

    def upload(self, sections: list[list[int] | array]) -> list[torch.Tensor]:
        """Device views of the sections, in order, after one host-to-device copy. Each section
        starts 16-byte aligned: Triton specializes a kernel on whether each pointer argument is,
        so unaligned views would compile (mid-serving) another variant per combination."""
        flat = array("i")
        starts = []
        for section in sections:
            flat.extend(_ALIGN_PAD[: -len(flat) % _ALIGN])
            starts.append(len(flat))
            flat.extend(section)
        if len(flat) > self.host.numel():
            size = max(len(flat), 2 * self.host.numel(), 4096)
            self.host = torch.empty(size, dtype=torch.int32, pin_memory=self.pin)
            self.dev = torch.empty(size, dtype=torch.int32, device=self.device)
        if flat:
            if self.copied is not None:
                self.copied.synchronize()  # the last copy has read `host`: it may be rewritten
                self.copied = None
            self.host[: len(flat)].copy_(torch.frombuffer(flat, dtype=torch.int32))
            self.dev[: len(flat)].copy_(self.host[: len(flat)], non_blocking=True)
            if self.asynchronous:
                self.copied = self._record()
        return [
            self.dev[start : start + len(section)]
            for start, section in zip(starts, sections, strict=True)
        ]


def _table(seqs: list[ScheduledSeq], page_size: int, pad_rows: int) -> tuple[array, int]:
    """Row-major page table over the pages each sequence's context covers, padded with page 0
    (never read: each row is read only up to its context length)."""
    widths = [-(-(s.start_pos + len(s.token_ids)) // page_size) for s in seqs]
    width = max(widths, default=1)
    flat = array("i")
    for seq, w in zip(seqs, widths, strict=True):
        flat.extend(array("i", seq.page_ids[:w]))
        flat.extend(_zeros(width - w))
    flat.extend(_zeros(width * pad_rows))
    return flat, width


class DecodeTables:
    """The decode rows' page tables as int32 arrays, kept from one step to the next.

    Turning a Python int into an int32 costs tens of nanoseconds; a step of 256 decodes over 2k
    tokens each (128 pages of 16) spent about 1.4 ms on that alone, every step, with the device
    idle. A decoding sequence's page list only grows (a page every page_size tokens), so each row
    is kept and compared (list equality, pointer-fast for the same int objects) instead: only
    new pages are converted. Anything else (a cached prefix swapped in, drafts trimmed, a
    preempted request back with new pages) fails the comparison and the row is rebuilt.
    Rows of requests missing from a step are dropped."""

    def __init__(self) -> None:
        self._rows: dict[str, tuple[list[int], array]] = {}

    def table(
        self, decodes: list[ScheduledSeq], page_size: int, pad_rows: int
    ) -> tuple[array, int]:
        widths = [-(-(s.start_pos + 1) // page_size) for s in decodes]
        width = max(widths, default=1)
        flat = array("i")
        rows: dict[str, tuple[list[int], array]] = {}
        known = self._rows
        for seq, w in zip(decodes, widths, strict=True):
            pages = seq.page_ids[:w]
            row = known.get(seq.request_id)
            if row is None or row[0] != pages:
                if row is not None and len(row[0]) < w and pages[: len(row[0])] == row[0]:
                    row = (pages, row[1] + array("i", pages[len(row[0]) :]))
                else:
                    row = (pages, array("i", pages))
            rows[seq.request_id] = row
            flat.extend(row[1])
            flat.extend(_zeros(width - w))
        flat.extend(_zeros(width * pad_rows))
        self._rows = rows
        return flat, width


_ZEROS = array("i", bytes(4 * 4096))


def _zeros(n: int) -> array:
    return _ZEROS[:n] if n <= len(_ZEROS) else array("i", bytes(4 * n))


@dataclass(slots=True)
class TritonStep:
    input_ids: torch.Tensor  # [num_tokens] int32
    positions: torch.Tensor  # [num_tokens] int32
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [num_sampled] int32, batch order
    first_row: dict[str, int]  # request id -> the row of its chunk's first token
    num_real_decodes: int  # decodes before padding


class TritonBatchPacker:
    def __init__(self, page_size: int, kv_heads: int, device: torch.device, num_sms: int) -> None:
        self.page_size = page_size
        self.kv_heads = kv_heads
        self.num_sms = num_sms
        self.staging = HostStaging(device)
        self.decode_tables = DecodeTables()

    def build(self, seqs: list[ScheduledSeq], pad_decodes_to: int = 0) -> TritonStep:
        """Pack the batch (module docstring); decodes padded to `pad_decodes_to` rows."""
        decodes = [s for s in seqs if len(s.token_ids) == 1]
        chunks = [s for s in seqs if len(s.token_ids) > 1]
        pad = max(pad_decodes_to - len(decodes), 0)
        ids, pos, slots, first_row = self._rows(decodes, chunks, pad)
        sample_rows = [first_row[s.request_id] + len(s.token_ids) - 1 for s in seqs if s.sample]
        decode_lens = [s.start_pos + 1 for s in decodes] + [0] * pad
        decode_table, decode_width = self.decode_tables.table(decodes, self.page_size, pad)
        starts = [0]
        for chunk in chunks:
            starts.append(starts[-1] + len(chunk.token_ids))
        extend_lens = [c.start_pos + len(c.token_ids) for c in chunks]
        extend_table, extend_width = _table(chunks, self.page_size, 0)
        views = self.staging.upload(
            [ids, pos, slots, sample_rows, decode_lens, decode_table, starts, extend_lens,
             extend_table]
        )  # fmt: skip
        num_decodes = len(decodes) + pad
        backend = TritonAttention(
            slot_mapping=views[2],
            num_decodes=num_decodes,
            decode_table=views[5].view(num_decodes, decode_width),
            decode_lens=views[4],
            num_splits=choose_num_splits(
                max(num_decodes, 1), self.kv_heads, max(decode_lens, default=1), self.num_sms
            ),
            extend_table=views[8].view(len(chunks), extend_width),
            extend_starts=views[6],
            extend_lens=views[7],
            max_extend_len=max((len(c.token_ids) for c in chunks), default=0),
        )
        meta = AttentionMetadata(views[2], [], [], backend=backend)
        return TritonStep(views[0], views[1], meta, views[3], first_row, len(decodes))

    def _rows(
        self, decodes: list[ScheduledSeq], chunks: list[ScheduledSeq], pad: int
    ) -> tuple[list[int], list[int], list[int], dict[str, int]]:
        size = self.page_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        first_row: dict[str, int] = {}
        for seq in decodes:
            first_row[seq.request_id] = len(ids)
            ids.append(seq.token_ids[0])
            pos.append(seq.start_pos)
            slots.append(seq.page_ids[seq.start_pos // size] * size + seq.start_pos % size)
        ids += [0] * pad
        pos += [0] * pad
        slots += [-1] * pad
        for seq in chunks:
            first_row[seq.request_id] = len(ids)
            start, end = seq.start_pos, seq.start_pos + len(seq.token_ids)
            ids += seq.token_ids
            pos += range(start, end)
            slots += [seq.page_ids[p // size] * size + p % size for p in range(start, end)]
        return ids, pos, slots, first_row
