"""Engine bugs the stateful fuzzer (tests/engine/engine_fuzz.py) ran into, each as the smallest
reproduction; strict xfail until fixed, so the fix shows up as an XPASS to turn into a test."""

from __future__ import annotations

import pytest

from tests.engine.engine_fuzz import FuzzWorld, build_model_folder, drain, step, submit
from yaied.core.request import FinishReason, SamplingParams


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    world = FuzzWorld(build_model_folder(tmp_path_factory.mktemp("fuzz-model")))
    yield world
    world.close()


def generate(world: FuzzWorld, prompt: list[int], params: SamplingParams):
    stream = submit(world.engine, prompt, params)
    while step(world.engine):
        pass
    events = drain(stream)
    return [t for e in events for t in e.token_ids], "".join(e.text for e in events), events[-1]


def test_a_stop_string_does_not_stop_before_min_tokens(world):
    prompt = [65, 66, 67, 68]
    plain = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    tokens, _, _ = generate(world, prompt, plain)
    # A character the second output token completes (the first is half a UTF-8 character).
    stop = world.decode(tokens[:2]).replace("\ufffd", "")[:1]
    assert stop, tokens
    params = SamplingParams(
        max_tokens=8, temperature=0.0, ignore_eos=True, min_tokens=4, stop=[stop]
    )
    got, text, last = generate(world, prompt, params)
    assert last.finish_reason is not FinishReason.ERROR
    # It used to end after 2 tokens on the string (vLLM fixed the same: vllm#21987, #22014).
    assert len(got) >= 4, (got, text, last.finish_reason, last.stop_reason)
