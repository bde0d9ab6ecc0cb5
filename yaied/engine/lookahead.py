"""Overlapped steps (engine.overlap_steps): the next decode step, scheduled while the one before
it still runs on the device, so that the host's work for one step (applying and streaming its
tokens, scheduling, packing) runs while the device computes the next instead of between steps.

The engine loop (StepLoop._run_overlapped, engine/step_loop.py) launches a step, calls
``schedule_ahead`` on it, launches the result with its input tokens read from the first step's
sampled ids on the device (Batch.previous_rows; ModelRunner.launch), and only then applies the
first step's output. It goes back to steps scheduled as usual whenever ``schedule_ahead`` declines.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from yaied.core.request import RequestStatus
from yaied.core.step import Batch, ScheduledSeq

if TYPE_CHECKING:
    from yaied.core.config import EngineConfig
    from yaied.engine.scheduler import Scheduler
    from yaied.worker.worker import Worker

log = logging.getLogger(__name__)


def overlaps(config: EngineConfig, worker: Worker) -> bool:
    """engine.overlap_steps for this engine: auto means on a GPU (on CPU the host is the
    device: nothing would overlap); never with tensor parallelism (the ranks take every step's
    token ids from rank 0) or speculative decoding (a step ahead carries no drafts, so it would
    quietly stop speculating)."""
    mode = config.engine.overlap_steps
    wanted = mode == "on" or (mode == "auto" and worker.device.type == "cuda")
    blocker = None
    if worker.parallel is not None:
        blocker = "tensor parallelism"
    elif config.speculative.enabled:
        blocker = "speculative decoding"
    if mode == "on" and blocker is not None:  # asked for by name: say why it is not on
        log.warning(
            "engine.overlap_steps = on does not apply with %s: steps run one by one", blocker
        )
    return wanted and blocker is None


def schedule_ahead(scheduler: Scheduler, batch: Batch) -> Batch | None:
    """The step after ``batch``, scheduled while ``batch`` is still on the device: every
    request of ``batch`` that stays running decodes the token that step is sampling for it,
    which reaches the worker on the device (Batch.previous_rows); its token_ids hold a
    placeholder. A request the step in flight takes to its length limit is left out; one it
    ends otherwise (EOS, a stop) is found out only after this step was launched: update() then
    skips its row, a wasted row. Its pages are safe to free meanwhile: the row writes K/V past
    the computed tokens, so into no page the prefix cache takes, and a page given to another
    request is written by that request's own later steps before any read.

    None, and the next step is scheduled as usual once ``batch`` is done, whenever that could
    differ: requests waiting or left out of ``batch``, a chunk that does not sample, drafts, a
    request whose next step needs its new token on the host (a grammar, penalties, min_tokens
    still to reach), logprobs (read on the host as the step is launched, which would wait for
    it, and so hold back the step before), or pages short (this never preempts)."""
    if scheduler.waiting:
        return None
    seqs: list[ScheduledSeq] = []
    rows: list[int] = []
    num_running = 0  # of the batch's requests: every running request must be among them
    for row, seq in enumerate(batch.seqs):
        request = scheduler.requests.get(seq.request_id)
        if request is None or request.status is not RequestStatus.RUNNING:
            continue  # ended by the step before (a wasted row in the step in flight)
        num_running += 1
        if not seq.sample or seq.num_draft_tokens:
            return None
        params = request.params
        num_output = len(request.output_token_ids) + 1  # with the token in flight
        if request.grammar is not None or params.has_penalties or params.pooling:
            return None
        if params.logprobs is not None:
            return None  # they are read on the host at launch: that would wait for the step
        if num_output < params.min_tokens:
            return None  # its sampler bans EOS until then: the banned ids need num_output
        position = seq.start_pos + len(seq.token_ids)  # where the token in flight goes
        if num_output >= params.max_tokens or position + 1 >= scheduler.max_model_len:
            continue  # the step in flight ends it
        if not scheduler.cache.reserve(request, position + 1 - request.num_computed_tokens):
            return None
        seqs.append(
            ScheduledSeq(
                request_id=request.request_id,
                token_ids=[0],  # the worker reads the token from the step in flight
                start_pos=position,
                page_ids=request.page_ids,
                sample=True,
                params=params,
                num_output_tokens=num_output,
            )
        )
        rows.append(row)
    if not seqs or num_running != len(scheduler.running):
        return None
    return Batch(seqs, len(seqs), previous_rows=rows)
