"""SequenceMatcher and the token bitmask: masks applied to random logits leave exactly the
grammar's tokens, errors stay with their sequence, CPU dtypes and (where present) CUDA."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
import xgrammar as xgr

from tests.structured.schemas import SCHEMA_CASES
from yaied.structured import (
    GrammarCompiler,
    SequenceMatcher,
    allocate_bitmask,
    apply_bitmask,
    fill_bitmasks,
    make_spec,
    row_allows_only,
)


def allowed_ids(host_row: torch.Tensor, vocab_size: int) -> set[int]:
    bits = (host_row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return set(torch.nonzero(bits.reshape(-1)[:vocab_size]).flatten().tolist())


@pytest.fixture(scope="module")
def sentiment(compiler: GrammarCompiler) -> Any:
    case = next(case for case in SCHEMA_CASES if case.name == "sentiment")
    return compiler.compile(make_spec("json_schema", case.schema, "guided_json"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mask_on_random_logits_leaves_only_allowed_tokens(
    sentiment: Any, vocab_size: int, encode: Callable, tokenizer: Any, dtype: torch.dtype
) -> None:
    rows = {1: '{"label": "', 4: '{"label": "positive", "confidence": 0.', 6: '{"label": "neu'}

    def after(prefix: str) -> SequenceMatcher:
        matcher = SequenceMatcher.create(sentiment)
        assert matcher.accept_tokens(encode(prefix))
        return matcher

    bitmask = allocate_bitmask(8, vocab_size)
    # Constrained rows among unconstrained ones; rows never filled hold garbage, unused.
    bitmask.host.random_(-(2**31), 2**31 - 1)
    fill_bitmasks([after(prefix) for prefix in rows.values()], bitmask, list(rows))
    logits = torch.randn(8, vocab_size, generator=torch.Generator().manual_seed(0)).to(dtype)
    before = logits.clone()
    apply_bitmask(logits, bitmask, list(rows))
    for row in range(8):
        if row not in rows:
            assert torch.equal(logits[row], before[row])  # unconstrained rows untouched
            continue
        finite = set(torch.nonzero(torch.isfinite(logits[row])).flatten().tolist())
        assert finite and finite == allowed_ids(bitmask.host[row], vocab_size)
        assert torch.equal(logits[row][sorted(finite)], before[row][sorted(finite)])
        for token in sorted(finite)[:50]:  # every allowed token is accepted...
            assert after(rows[row]).accept(token), tokenizer.decode([token])
        masked = sorted(set(range(vocab_size)) - finite)
        for token in random.Random(row).sample(masked, 50):  # ...and masked ones are refused
            assert not after(rows[row]).accept(token)
    # Inside the enum: only tokens that continue one of the labels (and may close the string).
    labels = ('positive"', 'negative"', 'neutral"')
    texts = {tokenizer.decode([t]) for t in allowed_ids(bitmask.host[1], vocab_size)}
    assert all(any(label.startswith(text) for label in labels) for text in texts)
    texts = {tokenizer.decode([t]) for t in allowed_ids(bitmask.host[6], vocab_size)}
    assert all('tral"'.startswith(text) for text in texts)


def test_batch_fill_equals_one_by_one(
    compiler: GrammarCompiler, vocab_size: int, encode: Callable
) -> None:
    matchers, rows = [], []
    for row, case in enumerate(SCHEMA_CASES[:8]):
        compiled = compiler.compile(make_spec("json_schema", case.schema, "guided_json"))
        matcher = SequenceMatcher.create(compiled)
        text = json.dumps(case.valid[0])
        assert matcher.accept_tokens(encode(text[: len(text) // 2])[:-1])
        matchers.append(matcher)
        rows.append(row * 2)
    one, batch = allocate_bitmask(16, vocab_size), allocate_bitmask(16, vocab_size)
    fill_bitmasks(matchers, one, rows)
    fill_bitmasks(matchers, batch, rows, batch=xgr.BatchGrammarMatcher(max_threads=2))
    assert torch.equal(one.host[rows], batch.host[rows])


def test_errors_stay_with_their_sequence(
    sentiment: Any, vocab_size: int, encode: Callable, tokenizer: Any
) -> None:
    eos = tokenizer.eos_token_id
    bad, good = SequenceMatcher.create(sentiment), SequenceMatcher.create(sentiment)
    assert not bad.accept(encode("[")[0])
    assert bad.failed and "not allowed" in (bad.error or "") and bad.num_accepted == 0
    assert not bad.accept(encode("{")[0])  # a failed matcher refuses everything after
    assert not bad.accept(vocab_size + 10) and not bad.accept(-1)
    done = SequenceMatcher.create(sentiment)
    assert done.accept_tokens([*encode('{"label": "neutral", "confidence": 1}'), eos])
    assert done.is_terminated and not done.accept(eos) and "terminated" in (done.error or "")
    # Failed and terminated rows allow only the stop token; the healthy row is unaffected.
    bitmask = allocate_bitmask(3, vocab_size)
    bitmask.host.fill_(-1)
    fill_bitmasks([bad, good, done], bitmask, [0, 1, 2], batch=xgr.BatchGrammarMatcher(2))
    assert allowed_ids(bitmask.host[0], vocab_size) == {eos}
    assert allowed_ids(bitmask.host[2], vocab_size) == {eos}
    first = {tokenizer.decode([t]) for t in allowed_ids(bitmask.host[1], vocab_size)}
    assert "{" in first and all(text.startswith("{") for text in first)


def test_rollback_and_reset(sentiment: Any, encode: Callable, vocab_size: int) -> None:
    matcher = SequenceMatcher.create(sentiment)
    ids = encode('{"label": "negative"')
    assert matcher.accept_tokens(ids) and matcher.num_accepted == len(ids)
    bitmask = allocate_bitmask(2, vocab_size)
    matcher.fill_bitmask(bitmask, 0)
    assert matcher.accept_tokens(encode(", "))
    matcher.rollback(len(encode(", ")))
    matcher.fill_bitmask(bitmask, 1)
    assert torch.equal(bitmask.host[0], bitmask.host[1]) and matcher.num_accepted == len(ids)
    assert not matcher.accept(encode("]")[0])
    matcher.reset()
    assert not matcher.failed and matcher.num_accepted == 0 and matcher.accept_tokens(ids)


def test_padded_logits_columns_are_masked(sentiment: Any, vocab_size: int) -> None:
    bitmask = allocate_bitmask(2, vocab_size)
    bitmask.host.fill_(-1)  # all allowed
    logits = torch.zeros(2, vocab_size + 32)
    apply_bitmask(logits, bitmask, [1])
    assert (
        torch.isfinite(logits[1, :vocab_size]).all() and torch.isinf(logits[1, vocab_size:]).all()
    )
    assert torch.isfinite(logits[0]).all()
    apply_bitmask(logits, bitmask, [])  # no constrained rows: nothing to do


def test_other_dtypes_take_the_torch_path(
    sentiment: Any, vocab_size: int, encode: Callable
) -> None:
    matcher = SequenceMatcher.create(sentiment)
    assert matcher.accept_tokens(encode('{"label": "'))
    bitmask = allocate_bitmask(1, vocab_size)
    matcher.fill_bitmask(bitmask, 0)
    logits = torch.randn(1, vocab_size, dtype=torch.float64)
    apply_bitmask(logits, bitmask, [0])
    finite = set(torch.nonzero(torch.isfinite(logits[0])).flatten().tolist())
    assert finite == allowed_ids(bitmask.host[0], vocab_size)


@pytest.mark.cuda
def test_cuda_matches_cpu(sentiment: Any, vocab_size: int, encode: Callable) -> None:
    matcher = SequenceMatcher.create(sentiment)
    assert matcher.accept_tokens(encode('{"label": "'))
    cpu_mask, gpu_mask = allocate_bitmask(4, vocab_size), allocate_bitmask(4, vocab_size, "cuda")
    assert gpu_mask.host.is_pinned()
    for bitmask in (cpu_mask, gpu_mask):
        matcher.fill_bitmask(bitmask, 2)
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(4, vocab_size, dtype=dtype)
        on_gpu = logits.cuda()
        apply_bitmask(logits, cpu_mask, [2])
        apply_bitmask(on_gpu, gpu_mask, [2])
        assert torch.equal(on_gpu.cpu(), logits)


def test_row_allows_only(vocab_size: int) -> None:
    bitmask = allocate_bitmask(2, vocab_size)
    bitmask.host.zero_()
    for token in (2, 31, 63):  # bit 31: the int32 sign bit
        bitmask.host[0, token // 32] |= torch.tensor(1 << (token % 32)).to(torch.int32)
    assert row_allows_only(bitmask, 0, [2, 31, 63]) and row_allows_only(bitmask, 0, [2, 31, 63, 7])
    assert not row_allows_only(bitmask, 0, [2, 31])
    assert row_allows_only(bitmask, 1, [])  # nothing allowed at all
    assert allowed_ids(bitmask.host[0], vocab_size) == {2, 31, 63}  # the row is left unchanged
