"""Finish reasons through the official openai client: length, stop on a stop string, and a stop
string that ends on the last token max_tokens allows (stop, not length)."""

from __future__ import annotations

import openai
import pytest

from tests.server.conftest import MODEL

PROMPT = "The three primary colours are red, yellow and"


@pytest.mark.timeout(120)
def test_finish_reasons_with_the_openai_client(live):
    client = openai.OpenAI(base_url=live.v1, api_key="none")
    free = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert free.choices[0].finish_reason == "length"
    tokens = (
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=0
        )
        .choices[0]
        .logprobs.tokens
    )
    # The first token whose text is a word not seen before it: a stop string it completes.
    for k in range(2, len(tokens) + 1):
        before, piece = "".join(tokens[: k - 1]), tokens[k - 1].strip()
        if len(piece) >= 2 and piece not in before:
            break
    else:
        pytest.fail(f"no usable stop string in {tokens!r}")
    for max_tokens in (k, k + 3):  # the stop ends on the last allowed token, then well before
        out = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=max_tokens, temperature=0, stop=[piece]
        ).choices[0]
        assert out.finish_reason == "stop", max_tokens
        assert out.text == before.rstrip(" ") or out.text == before
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=k, temperature=0, stop=[piece], stream=True
    )
    reasons = [c.choices[0].finish_reason for c in stream if c.choices]
    assert reasons[-1] == "stop" and set(reasons[:-1]) <= {None}
