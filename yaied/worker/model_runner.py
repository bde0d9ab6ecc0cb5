"""Turns a Batch into tensors, runs the model, samples: one forward and one host copy a step."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from yaied.core.request import TokenLogprobs
from yaied.core.step import Batch, ScheduledSeq, StepOutput
from yaied.kernels.cpu_decode import CpuDecodeKernel
from yaied.kernels.cpu_fused import CpuFusedOps
from yaied.kernels.cpu_prefill import CpuPrefillKernel
from yaied.structured import TokenBitmask, apply_bitmask
from yaied.worker.logprobs import prompt_logprobs, sampled_logprobs
from yaied.worker.sampler import SamplingTensors, sample
from yaied.worker.speculative import position_rows, verify
from yaied.worker.torch_packing import TorchBatchPacker, upload

if TYPE_CHECKING:  # the Triton path's modules import triton: only on that path
    from yaied.worker.cuda_graphs import DecodeGraphs
    from yaied.worker.gpu_packing import TritonBatchPacker


@dataclass(slots=True)
class LaunchedStep:
    """A step whose device work is queued (ModelRunner.launch): what collect() needs."""

    batch: Batch
    token_ids: torch.Tensor  # [num_rows] sampled, on the device: a next step's inputs
    host: torch.Tensor  # the sampled ids then the finite marks, on the host once `copied`
    copied: torch.cuda.Event | None  # recorded after the copy to the host (CUDA only)
    num_rows: int  # sampled rows
    drafted: bool
    started: float  # perf_counter() when the step's work began (its model_time)
    mask_time: float
    logprobs: list[TokenLogprobs | None] | None
    prompt: dict[str, list[TokenLogprobs | None]]
    pooled: dict[str, list[float]]


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        page_size: int,
        vocab_size: int,
        device: torch.device,
        seed: int = 0,
        triton: TritonBatchPacker | None = None,
        batch_invariant: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.page_size = page_size
        self.vocab_size = vocab_size
        self.device = device
        # The math's (activations'), and the pools' where they differ (cache.kv_cache_dtype)
        self.kv_dtype = kv_caches[0][0].dtype
        self.dtype = dtype or self.kv_dtype
        # The Triton path (on a GPU; on CPU only in the interpreter, for tests) builds its own
        # inputs and attends with the kernels in yaied/kernels; the torch path uses the rest.
        self.triton = triton
        self.graphs: DecodeGraphs | None = None  # set by the worker once captured
        cpu_kernel = device.type == "cpu" and triton is None
        # engine.batch_invariant (worker/batch_invariant.py): every row on the prefill path, so
        # no decode kernel (nor its build at start-up)
        decodes = cpu_kernel and not batch_invariant
        self.decode_kernel = self._load_decode_kernel(model) if decodes else None
        self.prefill_kernel = self._load_prefill_kernel(model) if cpu_kernel else None
        self.packer = TorchBatchPacker(
            page_size, device, self.dtype, kv_caches[0][0].shape[0], self.decode_kernel,
            self.prefill_kernel, every_token_prefill=batch_invariant,
            attention_shape=self._attention_shape(model),
        )  # fmt: skip
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def _attention_shape(self, model: nn.Module) -> tuple[int, int] | None:
        """(query heads, head dim) where the prefill kernel runs (the packer sizes chunks by it)."""
        if self.prefill_kernel is None:
            return None
        return model.shape.num_heads, model.shape.head_dim

    def _load_decode_kernel(self, model: nn.Module) -> CpuDecodeKernel | None:
        kernel = CpuDecodeKernel.load()
        shape = model.shape
        group = shape.num_heads // shape.num_kv_heads
        if kernel is None or not kernel.supports(self.dtype, group, shape.head_dim, self.kv_dtype):
            return None
        return kernel

    def _load_prefill_kernel(self, model: nn.Module) -> CpuPrefillKernel | None:
        shape = model.shape
        group = shape.num_heads // shape.num_kv_heads
        if not CpuPrefillKernel.supports(self.dtype, group, shape.head_dim, self.kv_dtype):
            return None
        return CpuPrefillKernel.load()

    def execute(self, batch: Batch) -> StepOutput:
        return self.collect(self.launch(batch))

    @torch.inference_mode()
    def launch(self, batch: Batch, previous: LaunchedStep | None = None) -> LaunchedStep:
        """Queue the step's device work: the forward, sampling, and the copy of the sampled ids
        to the host, which collect() waits for. On CPU the work is done when this returns.
        ``previous``: the step in flight that samples this one's input tokens
        (batch.previous_rows); they go from its sampled ids to this step's inputs on the device."""
        start = time.perf_counter()
        inputs = None
        if batch.previous_rows is not None:
            assert previous is not None, "a step scheduled ahead needs the step before it"
            inputs = previous.token_ids
            if batch.previous_rows != list(range(len(inputs))):  # some left out: gather
                rows = torch.tensor(batch.previous_rows, dtype=torch.int64)
                inputs = inputs[rows.to(inputs.device, non_blocking=True)]
        hidden, sample_rows, first_row = self._forward(batch.seqs, inputs)
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
        ops = getattr(self.model, "fused_ops", None)
        masker = ops.apply_token_bitmask if isinstance(ops, CpuFusedOps) else None
        mask_time = _apply_grammars(logits, rows, batch.grammar_bitmask, masker)
        token_ids = self._sample(logits, rows)
        logprobs = sampled_logprobs(logits, token_ids, [s.params.logprobs for s in rows])
        finite = self._finite_rows(batch.seqs, hidden, first_row, _per_seq_max(logits, sampling))
        prompt = self._prompt_logprobs(batch.seqs, hidden, first_row)
        pooled = _pooled(batch.seqs, hidden, first_row)
        # With no logprobs asked for, the step's one host sync (in collect): tokens, then the
        # finite marks, in one copy.
        values = torch.cat([token_ids, finite.to(token_ids.dtype)])
        copied = None
        if values.device.type == "cuda":
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            host.copy_(values, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        else:
            host = values
        return LaunchedStep(
            batch, token_ids, host, copied, len(rows), drafted, start, mask_time, logprobs,
            prompt, pooled,
        )  # fmt: skip

    def collect(self, step: LaunchedStep) -> StepOutput:
        """Wait for a launched step's sampled ids and finish it into a StepOutput."""
        if step.copied is not None:
            step.copied.synchronize()
        host = step.host.tolist()
        num_rows = step.num_rows
        failed = {
            seq.request_id: "the model produced non-finite values (NaN or inf)"
            for seq, ok in zip(step.batch.seqs, host[num_rows:], strict=True)
            if not ok
        }
        out = StepOutput(
            host[:num_rows],
            failed=failed,
            model_time=time.perf_counter() - step.started,
            sampled_logprobs=step.logprobs,
            prompt_logprobs=step.prompt,
            mask_time=step.mask_time,
            pooled=step.pooled,
        )
        if step.drafted:
            # rows -> one token per sequence, after its accepted drafts
            verify([seq for seq in step.batch.seqs if seq.sample], out)
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
        sampled = [i for i, s in enumerate(seqs) if s.sample]
        if len(sampled) == len(seqs):
            # Every sequence samples from its last row, and a NaN or inf in that row reaches
            # every logit of it (the head multiplies it in): the logits vouch for the row.
            return torch.isfinite(logits.amax(dim=-1))
        last_rows = [first_row[s.request_id] + len(s.token_ids) - 1 for s in seqs]
        rows, index = upload([last_rows, sampled], hidden.device)
        finite = torch.isfinite(hidden[rows]).all(dim=-1)
        if sampled:
            finite[index] = finite[index] & torch.isfinite(logits.amax(dim=-1))
        return finite

    def _forward(
        self, seqs: list[ScheduledSeq], inputs: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, int]]:
        """(hidden states of every row, the rows to sample, request id -> first row). inputs:
        the input tokens of seqs (all single-token), on the device, instead of their token_ids."""
        if self.triton is None:
            prepared = self.packer.build(seqs)
            if inputs is not None:
                prepared.input_ids[: len(seqs)] = inputs
            hidden = self.model(
                prepared.input_ids, prepared.positions, self.kv_caches, prepared.meta
            )
            return hidden, prepared.sample_rows, prepared.first_row
        num_decodes = sum(len(s.token_ids) == 1 for s in seqs)
        size = self.graphs.padded_size(num_decodes, len(seqs)) if self.graphs else None
        step = self.triton.build(seqs, pad_decodes_to=size or 0)
        if inputs is not None:
            step.input_ids[: len(seqs)] = inputs  # decodes come first, in batch order
        if size is not None:
            hidden = self.graphs.run(step)
        else:
            hidden = self.model(step.input_ids, step.positions, self.kv_caches, step.meta)
        return hidden, step.sample_rows, step.first_row

    def _sample(self, logits: torch.Tensor, seqs: list[ScheduledSeq]) -> torch.Tensor:
        # Plain greedy rows need only an argmax: no per-row settings to build and copy over.
        if all(s.params.greedy and not _needs_processing(s) for s in seqs):
            return self._argmax(logits)
        return sample(logits, self._sampling_tensors(seqs), self.generator)

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's argmax; on CPU by the fused kernels' (several times faster than torch's,
        the same indices) where the model runs them."""
        ops = getattr(self.model, "fused_ops", None)
        if logits.device.type == "cpu" and isinstance(ops, CpuFusedOps):
            return ops.argmax(logits)
        return logits.argmax(dim=-1)

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


def _pooled(
    seqs: list[ScheduledSeq], hidden: torch.Tensor, first_row: dict[str, int]
) -> dict[str, list[float]]:
    """The pooling sequences' share of StepOutput.pooled: a chunk's row sum ("mean") or its
    last row once the prompt ends ("last"), one host copy for all of them."""
    names: list[str] = []
    vectors: list[torch.Tensor] = []
    for seq in seqs:
        mode = seq.params.pooling
        if mode is None or (mode == "last" and not seq.sample):
            continue
        first = first_row[seq.request_id]
        end = first + len(seq.token_ids)  # hidden: [num_tokens, hidden]; this chunk's rows
        rows = hidden[first:end] if mode == "mean" else hidden[end - 1 : end]
        names.append(seq.request_id)
        vectors.append(rows.float().sum(dim=0))
    if not vectors:
        return {}
    return dict(zip(names, torch.stack(vectors).tolist(), strict=True))


def _per_seq_max(logits: torch.Tensor, seqs: list[ScheduledSeq]) -> torch.Tensor:
    """[len(seqs), 1]: each sequence's logits maxima summed over its rows (one row unless it
    had drafts), finite exactly when every one of its rows has a finite maximum."""
    if logits.shape[0] == len(seqs):
        return logits.amax(dim=-1, keepdim=True)
    owner = [i for i, s in enumerate(seqs) for _ in range(s.num_draft_tokens + 1)]
    index = torch.tensor(owner, dtype=torch.int64, device=logits.device)
    summed = torch.zeros(len(seqs), dtype=logits.dtype, device=logits.device)
    return summed.index_add_(0, index, logits.amax(dim=-1)).unsqueeze(1)


def _apply_grammars(
    logits: torch.Tensor,
    seqs: list[ScheduledSeq],
    bitmask: TokenBitmask | None,
    cpu_kernel: Callable | None = None,
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
    apply_bitmask(logits, bitmask, [i for i, _ in pairs], cpu_kernel)
    return time.perf_counter() - start


def _needs_processing(seq: ScheduledSeq) -> bool:
    """Whether the sampler changes this row's logits before its argmax."""
    return bool(seq.params.logit_bias or seq.params.has_penalties or seq.banned_token_ids)
