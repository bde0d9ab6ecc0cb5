"""SamplingParams: the OpenAI knobs are validated at construction and params stay hashable."""

from __future__ import annotations

import pytest

from yaied.core.request import MAX_LOGPROBS, SamplingParams


def test_logit_bias_is_stored_sorted_clamped_and_hashable():
    p = SamplingParams(logit_bias={9: 150, "3": -2.5, 4: -101.0})
    assert p.logit_bias == ((3, -2.5), (4, -100.0), (9, 100.0))
    assert p == SamplingParams(logit_bias=[(4, -100), (9, 100), (3, -2.5)])
    assert hash(p) == hash(SamplingParams(logit_bias={3: -2.5, 4: -100.0, 9: 100.0}))


def test_defaults_leave_every_knob_off():
    p = SamplingParams()
    assert not p.has_penalties and p.logit_bias == () and p.seed is None
    assert p.logprobs is None and p.prompt_logprobs is None and p.min_tokens == 0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"seed": 1.5}, "seed"),
        ({"seed": True}, "seed"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
        ({"logit_bias": {5: float("inf")}}, "logit_bias"),
        ({"logit_bias": 3}, "logit_bias"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 17}, "min_tokens"),  # above max_tokens=16
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": 2.0}, "prompt_logprobs"),
    ],
)
def test_bad_knobs_name_their_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_edges_are_accepted_and_kept_as_given():
    p = SamplingParams(presence_penalty=-2, frequency_penalty=2, repetition_penalty=0.5, seed=-7)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (-2, 2, 0.5)
    assert p.seed == -7 and p.has_penalties
    q = SamplingParams(max_tokens=4, min_tokens=4, logprobs=MAX_LOGPROBS, prompt_logprobs=0)
    assert (q.max_tokens, q.min_tokens, q.logprobs, q.prompt_logprobs) == (4, 4, MAX_LOGPROBS, 0)
    assert not q.has_penalties
    r = SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, min_p=1.0, seed=2**70)
    assert r.greedy and r.top_k == 0  # -1 is stored as 0: disabled either way
    assert (r.top_p, r.min_p, r.seed) == (1.0, 1.0, 2**70)
