"""Stop strings on the default model (it has a tokenizer): the finish reason when a stop string
and max_tokens end the request on the same token."""

from __future__ import annotations

import pytest

from yaied import LLM
from yaied.core.request import FinishReason
from yaied.worker.model_files import DEFAULT_MODEL_NAME

PROMPT = "The three primary colours are red, yellow and"


@pytest.fixture(scope="module")
def llm():
    engine = LLM(DEFAULT_MODEL_NAME, dtype="float32", show_progress=False)
    yield engine
    engine.close()


@pytest.mark.slow
def test_a_stop_string_completed_by_the_last_allowed_token_reports_stop(llm):
    free = llm.generate(PROMPT, max_tokens=12, temperature=0.0, ignore_eos=True)[0]
    tokens = free.token_ids
    # The first k whose text ends in a piece that appears nowhere before it: the stop string.
    for k in range(2, len(tokens) + 1):
        text = llm.tokenizer.decode(tokens[:k])
        piece = text[len(llm.tokenizer.decode(tokens[: k - 1])) :].strip()
        if len(piece) >= 2 and text.find(piece) == len(text.rstrip()) - len(piece):
            break
    else:
        pytest.fail(f"no usable stop string in {free.text!r}")
    out = llm.generate(PROMPT, max_tokens=k, stop=[piece], temperature=0.0, ignore_eos=True)[0]
    assert out.token_ids == tokens[:k]
    assert out.finish_reason is FinishReason.STOP and out.stop_reason == piece
    assert piece not in out.text  # cut as for any stop string
    # One token more allowed: the same stop, as before.
    more = llm.generate(PROMPT, max_tokens=k + 1, stop=[piece], temperature=0.0)[0]
    assert more.finish_reason is FinishReason.STOP and more.text == out.text
