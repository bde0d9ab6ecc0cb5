"""A step that raised: whether the engine can go on, and the step again one sequence at a time
(Worker.execute), so that a request that breaks it fails alone and the rest go on."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from yaied.core.request import TokenLogprobs
from yaied.core.step import Batch, StepOutput
from yaied.worker.parallel.group import RankFailure

log = logging.getLogger(__name__)


def is_fatal(exc: BaseException) -> bool:
    """Errors after which the device cannot be trusted: CUDA's sticky errors (an illegal address,
    a device-side assert) fail every later call in this process."""
    if isinstance(exc, torch.AcceleratorError | RankFailure):
        return True  # a RankFailure: another tensor-parallel rank died or hangs
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        mark in text for mark in ("CUDA error", "device-side assert", "CUBLAS_STATUS")
    )


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def rerun_one_by_one(
    batch: Batch,
    error: str,
    execute: Callable[[Batch], StepOutput],
    fatal: Callable[[Exception], bool],
) -> StepOutput:
    """The step again, one sequence a step (``execute``), merged into one StepOutput in batch
    order. K/V writes are idempotent, so running a sequence twice is harmless. ``fatal`` says
    whether an exception stops the engine (then the whole step is fatal)."""
    merged = StepOutput([])
    logprobs: list[TokenLogprobs | None] = []
    accepted: list[int] = []  # drafts accepted, per sampling sequence
    for seq in batch.seqs:
        try:
            alone = Batch([seq], len(seq.token_ids), grammar_bitmask=batch.grammar_bitmask)
            out = execute(alone)
        except Exception as exc:
            if fatal(exc):
                return StepOutput([], error=describe(exc), fatal=True)
            log.error("request %s failed alone: %s", seq.request_id, describe(exc))
            out = StepOutput([0] if seq.sample else [], failed={seq.request_id: describe(exc)})
        merged.sampled_token_ids += out.sampled_token_ids
        if seq.sample:
            logprobs.append(out.sampled_logprobs[0] if out.sampled_logprobs else None)
            accepted.append(out.num_accepted_drafts[0] if out.num_accepted_drafts else 0)
        merged.failed.update(out.failed)
        merged.draft_logprobs.update(out.draft_logprobs)
        merged.prompt_logprobs.update(out.prompt_logprobs)
        merged.model_time += out.model_time
        merged.mask_time += out.mask_time
    if len(merged.failed) == len(batch.seqs):
        return StepOutput([], error=error)  # nothing ran: the step failed as a whole
    if any(lp is not None for lp in logprobs):
        merged.sampled_logprobs = logprobs
    if any(accepted):
        merged.num_accepted_drafts = accepted
    return merged
