"""The worker's side of structured outputs, without a model: each constrained row's logits are
masked with its bitmask row before sampling, other rows untouched, also when a failed step is
rerun one sequence at a time (the bitmask row then differs from the logits row); and the
engine's StepMasks gives each sampling constrained sequence its logits row."""

from __future__ import annotations

import torch

from yaied.core.request import Request, SamplingParams
from yaied.core.step import Batch, ScheduledSeq
from yaied.engine.grammar import StepMasks
from yaied.structured import allocate_bitmask
from yaied.worker.model_runner import _apply_grammars

VOCAB = 100


def seq(request_id: str, sample: bool = True, grammar_row: int | None = None) -> ScheduledSeq:
    return ScheduledSeq(request_id, [1], 0, [0], sample, SamplingParams(), grammar_row=grammar_row)


def allow(bitmask, row: int, tokens: list[int]) -> None:
    bitmask.host[row].zero_()
    for token in tokens:
        word, bit = divmod(token, 32)
        bitmask.host[row, word] |= torch.tensor(1 << bit).to(torch.int32)


def finite(logits: torch.Tensor, row: int) -> set[int]:
    return set(torch.nonzero(torch.isfinite(logits[row])).flatten().tolist())


def test_constrained_rows_are_masked_and_the_others_untouched():
    bitmask = allocate_bitmask(4, VOCAB)
    allow(bitmask, 1, [3, 40])
    allow(bitmask, 2, [99])
    logits = torch.randn(3, VOCAB)
    before = logits.clone()
    seqs = [seq("a"), seq("b", grammar_row=1), seq("c", grammar_row=2)]
    seconds = _apply_grammars(logits, seqs, bitmask)
    assert seconds >= 0.0
    assert torch.equal(logits[0], before[0])
    assert finite(logits, 1) == {3, 40} and finite(logits, 2) == {99}
    assert torch.equal(logits[1, [3, 40]], before[1, [3, 40]])


def test_a_sequence_rerun_alone_keeps_its_bitmask_row():
    bitmask = allocate_bitmask(4, VOCAB)
    allow(bitmask, 3, [7])
    logits = torch.randn(1, VOCAB)
    _apply_grammars(logits, [seq("d", grammar_row=3)], bitmask)  # logits row 0, bitmask row 3
    assert finite(logits, 0) == {7}
    assert _apply_grammars(logits, [seq("e")], None) == 0.0  # nothing constrained


class Allows:
    """A stand-in matcher: fills its row with one allowed token (EOS, id 2)."""

    error = None
    is_terminated = False

    def fill_bitmask(self, bitmask, row: int) -> bool:
        allow(bitmask, row, [2])
        return True


def test_step_masks_give_each_constrained_sampling_sequence_its_logits_row():
    requests = {name: Request(name, [1], SamplingParams()) for name in "abcd"}
    requests["b"].grammar = requests["d"].grammar = Allows()
    seqs = [seq("a"), seq("b"), seq("c", sample=False), seq("d")]
    seqs[3].banned_token_ids = (2,)  # min_tokens bans EOS, the only token d's grammar allows
    batch = Batch(seqs, 4)
    masks = StepMasks(8, VOCAB, "cpu")
    masks.fill(batch, requests)
    assert [s.grammar_row for s in seqs] == [None, 1, None, 2]  # sampled rows: a 0, b 1, d 2
    assert batch.grammar_bitmask is not None and masks.steps == 1
    assert seqs[3].banned_token_ids == ()  # lifted: the row would have nothing left
    unconstrained = Batch([seq("a")], 1)
    masks.fill(unconstrained, requests)
    assert unconstrained.grammar_bitmask is None and masks.steps == 1
