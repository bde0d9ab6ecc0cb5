"""Turns a Batch into tensors, runs the model, samples: one forward and one host copy a step."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

from yaied.core.request import TokenLogprobs
from yaied.core.step import Batch, ScheduledSeq, StepOutput
from yaied.kernels.cpu_decode import CpuDecodeKernel
from yaied.kernels.cpu_prefill import CpuPrefillKernel
from yaied.structured import TokenBitmask, apply_bitmask
from yaied.worker.attention import AttentionMetadata, DecodeBucket, KernelDecodes, PrefillChunk
from yaied.worker.logprobs import prompt_logprobs, sampled_logprobs
from yaied.worker.sampler import SamplingTensors, sample
from yaied.worker.speculative import position_rows, verify

if TYPE_CHECKING:  # the Triton path's modules import triton: only on that path
    from yaied.worker.cuda_graphs import DecodeGraphs
    from yaied.worker.gpu_inputs import TritonInputBuilder

# Decodes are split into at most this many buckets of at least MIN_DECODE_BUCKET sequences.
MAX_DECODE_BUCKETS = 4
MIN_DECODE_BUCKET = 8


class PreparedInputs(NamedTuple):
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [num_sampled] int64, rows whose logits are sampled, batch order
    first_row: dict[str, int]  # request id -> the row of its chunk's first token


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        page_size: int,
        vocab_size: int,
        device: torch.device,
        seed: int = 0,
        triton: TritonInputBuilder | None = None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.page_size = page_size
        self.vocab_size = vocab_size
        self.device = device
        self.dtype = kv_caches[0][0].dtype
        # The Triton path (on a GPU; on CPU only in the interpreter, for tests) builds its own
        # inputs and attends with the kernels in yaied/kernels; the torch path uses the rest.
        self.triton = triton
        self.graphs: DecodeGraphs | None = None  # set by the worker once captured
        cpu_kernel = device.type == "cpu" and triton is None
        self.decode_kernel = self._load_decode_kernel(model) if cpu_kernel else None
        self.prefill_kernel = self._load_prefill_kernel(model) if cpu_kernel else None
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def _load_decode_kernel(self, model: nn.Module) -> CpuDecodeKernel | None:
        kernel = CpuDecodeKernel.load()
        shape = model.shape
        group = shape.num_heads // shape.num_kv_heads
        if kernel is None or not kernel.supports(self.dtype, group, shape.head_dim):
            return None
        return kernel

    def _load_prefill_kernel(self, model: nn.Module) -> CpuPrefillKernel | None:
        shape = model.shape
        group = shape.num_heads // shape.num_kv_heads
        if not CpuPrefillKernel.supports(self.dtype, group, shape.head_dim):
            return None
        return CpuPrefillKernel.load()

    @torch.inference_mode()
    def execute(self, batch: Batch) -> StepOutput:
        start = time.perf_counter()
        hidden, sample_rows, first_row = self._forward(batch.seqs)
        sampling = [seq for seq in batch.seqs if seq.sample]
        # Speculative drafts: a row per position from the last real token on, each with the
        # knobs as they stand there (yaied/worker/speculative.py); else a row per sequence.
        drafted = any(seq.num_draft_tokens for seq in sampling)
        rows = sampling
        if drafted:
            row_ids, rows = position_rows(sampling, first_row)
            sample_rows = torch.tensor(row_ids, dtype=torch.int64, device=hidden.device)
        logits = self.model.compute_logits(hidden[sample_rows])  # raw, [rows, vocab]
        # Grammars first, in place: every knob after, and the logprobs, see only allowed tokens.
        mask_time = _apply_grammars(logits, rows, batch.grammar_bitmask)
        token_ids = self._sample(logits, rows)
        logprobs = sampled_logprobs(logits, token_ids, [s.params.logprobs for s in rows])
        finite = self._finite_rows(batch.seqs, hidden, first_row, _per_seq_max(logits, sampling))
        prompt = self._prompt_logprobs(batch.seqs, hidden, first_row)
        # With no logprobs asked for, the step's one host sync: tokens, then the finite marks.
        host = torch.cat([token_ids, finite.to(token_ids.dtype)]).tolist()
        failed = {
            seq.request_id: "the model produced non-finite values (NaN or inf)"
            for seq, ok in zip(batch.seqs, host[len(rows) :], strict=True)
            if not ok
        }
        out = StepOutput(
            host[: len(rows)],
            failed=failed,
            model_time=time.perf_counter() - start,
            sampled_logprobs=logprobs,
            prompt_logprobs=prompt,
            mask_time=mask_time,
        )
        if drafted:
            verify(sampling, out)  # rows -> one token per sequence, after its accepted drafts
        return out

    @staticmethod
    def _finite_rows(
        seqs: list[ScheduledSeq],
        hidden: torch.Tensor,
        first_row: dict[str, int],
        logits: torch.Tensor,
    ) -> torch.Tensor:
        """[num_seqs] bool, batch order: whether each sequence's values this step are finite.

        A chunk's last row attends to every position before it, so a NaN or inf in any K/V it
        wrote (or read) reaches that row's hidden state: checking one row per sequence vouches
        for the whole chunk before its pages enter the prefix cache. Sampled rows also check
        their logits (an overflow in the head); amax propagates NaN, and -inf alone is a
        legitimate mask and passes."""
        last_rows = [first_row[s.request_id] + len(s.token_ids) - 1 for s in seqs]
        sampled = [i for i, s in enumerate(seqs) if s.sample]
        rows, index = _upload([last_rows, sampled], hidden.device)
        finite = torch.isfinite(hidden[rows]).all(dim=-1)
        if sampled:
            finite[index] = finite[index] & torch.isfinite(logits.amax(dim=-1))
        return finite

    def _forward(
        self, seqs: list[ScheduledSeq]
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, int]]:
        """(hidden states of every row, the rows to sample, request id -> first row)."""
        if self.triton is None:
            prepared = self._prepare(seqs)
            hidden = self.model(
                prepared.input_ids, prepared.positions, self.kv_caches, prepared.meta
            )
            return hidden, prepared.sample_rows, prepared.first_row
        num_decodes = sum(len(s.token_ids) == 1 for s in seqs)
        size = self.graphs.padded_size(num_decodes, len(seqs)) if self.graphs else None
        step = self.triton.build(seqs, pad_decodes_to=size or 0)
        if size is not None:
            hidden = self.graphs.run(step)
        else:
            hidden = self.model(step.input_ids, step.positions, self.kv_caches, step.meta)
        return hidden, step.sample_rows, step.first_row

    def _sample(self, logits: torch.Tensor, seqs: list[ScheduledSeq]) -> torch.Tensor:
        # Plain greedy rows need only an argmax: no per-row settings to build and copy over.
        if all(s.params.greedy and not _needs_processing(s) for s in seqs):
            return logits.argmax(dim=-1)
        return sample(logits, self._sampling_tensors(seqs), self.generator)

    def _sampling_tensors(self, seqs: list[ScheduledSeq]) -> SamplingTensors:
        return SamplingTensors.build(
            [s.params for s in seqs],
            self.vocab_size,
            self.device,
            prompt_ids=[s.penalty_prompt_ids for s in seqs],
            output_ids=[s.penalty_output_ids for s in seqs],
            banned_ids=[s.banned_token_ids for s in seqs],
            num_output_tokens=[s.num_output_tokens for s in seqs],
        )

    def _prompt_logprobs(
        self, seqs: list[ScheduledSeq], hidden: torch.Tensor, first_row: dict[str, int]
    ) -> dict[str, list[TokenLogprobs | None]]:
        """Score each asking chunk's prompt_logprob_targets with its rows' logits, computed only
        for those rows. A chunk at position 0 gets a leading None: the first token has no
        context to be scored in."""
        asking = [s for s in seqs if s.prompt_logprob_targets is not None]
        if not asking:
            return {}
        rows: list[int] = []
        targets: list[int] = []
        num_top: list[int] = []
        for seq in asking:
            seq_targets = seq.prompt_logprob_targets or []
            first = first_row[seq.request_id]
            rows += range(first, first + len(seq_targets))
            targets += seq_targets
            num_top += [seq.params.prompt_logprobs or 0] * len(seq_targets)
        scored = iter(prompt_logprobs(hidden, self.model.compute_logits, rows, targets, num_top))
        out: dict[str, list[TokenLogprobs | None]] = {}
        for seq in asking:
            entries: list[TokenLogprobs | None] = [None] if seq.start_pos == 0 else []
            entries += [next(scored) for _ in seq.prompt_logprob_targets or []]
            out[seq.request_id] = entries
        return out

    def _prepare(self, seqs: list[ScheduledSeq]) -> PreparedInputs:
        """Pack the batch into rows: decodes first, sorted by context length so that each decode
        bucket is a contiguous run of rows, then prefill chunks. Sampled rows keep batch order.

        Python walks the sequences once, extending flat lists (ids, positions, page tables, each
        at C speed); one tensor carries them all, and slots and the kernel's page table come out
        of a few tensor ops over it, whatever the batch size or context length."""
        decodes = sorted((s for s in seqs if len(s.token_ids) == 1), key=lambda s: s.start_pos)
        # With the decode kernel, a decode carrying speculative drafts runs as one decode row
        # per position (each attends up to itself, K/V being written first): a prefill chunk
        # over cached context costs a gather and an SDPA call per layer, several times more.
        drafted = [s for s in seqs if s.num_draft_tokens and self.decode_kernel is not None]
        chunks = [s for s in seqs if len(s.token_ids) > 1 and not s.num_draft_tokens] + [
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
        ids_t, pos_t, lengths_t, starts_t, counts_t, pages_t, sample_t = _upload(
            [input_ids, positions, lengths, page_starts, page_counts, pages, sample_rows],
            torch.device("cpu"),
        )
        size = self.page_size
        num_rows = len(input_ids)
        row_page_start = starts_t.repeat_interleave(lengths_t, output_size=num_rows)
        slots = pages_t[row_page_start + pos_t // size] * size + pos_t % size
        prefill_chunks = [
            self._prefill_chunk(seq, first_row[seq.request_id], pages_t, start)
            for seq, start in zip(decodes + drafted + chunks, page_starts, strict=True)
            if len(seq.token_ids) > 1 and not (seq.num_draft_tokens and self.decode_kernel)
        ]
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
                )
                if self.decode_kernel
                else None
            ),
            prefill_kernel=self.prefill_kernel,
        )
        return PreparedInputs(
            ids_t.to(device), pos_t.to(device), meta, sample_t.to(device), first_row
        )

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
        kv_heads = self.kv_caches[0][0].shape[0]
        return DecodeBucket(
            start=start,
            count=len(decodes),
            page_table=torch.tensor(table, dtype=torch.int64, device=self.device),
            # [kv_heads * B, 1, max_len]: attention runs over (kv head, sequence) pairs
            bias=bias.repeat(kv_heads, 1).unsqueeze(1).to(self.device),
        )


def _per_seq_max(logits: torch.Tensor, seqs: list[ScheduledSeq]) -> torch.Tensor:
    """[len(seqs), 1]: each sequence's logits maxima summed over its rows (one row unless it
    had drafts), finite exactly when every one of its rows has a finite maximum."""
    if logits.shape[0] == len(seqs):
        return logits.amax(dim=-1, keepdim=True)
    owner = [i for i, s in enumerate(seqs) for _ in range(s.num_draft_tokens + 1)]
    index = torch.tensor(owner, dtype=torch.int64, device=logits.device)
    summed = torch.zeros(len(seqs), dtype=logits.dtype, device=logits.device)
    return summed.index_add_(0, index, logits.amax(dim=-1)).unsqueeze(1)


def _upload(lists: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """int64 tensors of ``lists`` on ``device``: on CUDA one pinned, non-blocking copy, so the
    step does not wait for the device here."""
    flat = torch.tensor([v for values in lists for v in values], dtype=torch.int64)
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    return list(flat.split([len(values) for values in lists]))


def _apply_grammars(
    logits: torch.Tensor, seqs: list[ScheduledSeq], bitmask: TokenBitmask | None
) -> float:
    """Mask the constrained rows' logits (row i is seqs[i]'s) with their bitmask rows, in place;
    returns the seconds spent. Unconstrained rows are not touched, so they sample as they would
    without constrained neighbours."""
    pairs = [(i, s.grammar_row) for i, s in enumerate(seqs) if s.grammar_row is not None]
    if not pairs or bitmask is None:
        return 0.0
    start = time.perf_counter()
    if any(i != row for i, row in pairs):
        # The batch was cut (a failed step rerun one sequence at a time): bring each sequence's
        # bitmask row to its logits row in a small copy.
        host = torch.zeros((len(seqs), bitmask.host.shape[1]), dtype=bitmask.host.dtype)
        for i, row in pairs:
            host[i] = bitmask.host[row]
        on_device = (
            None if logits.device.type == "cpu" else torch.empty_like(host, device=logits.device)
        )
        bitmask = TokenBitmask(host, on_device, bitmask.vocab_size)
    apply_bitmask(logits, bitmask, [i for i, _ in pairs])
    return time.perf_counter() - start


def _needs_processing(seq: ScheduledSeq) -> bool:
    """Whether the sampler changes this row's logits before its argmax."""
    return bool(seq.params.logit_bias or seq.params.has_penalties or seq.banned_token_ids)
