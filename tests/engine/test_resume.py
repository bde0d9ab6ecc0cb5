"""A call resumed after tokens another engine sent (``add_request(output_ids=)``): the rest of its
output is what one engine alone would have given, greedy or seeded, with penalties, logprobs,
stop strings and grammars, and usage counts the original prompt and every output token."""

from __future__ import annotations

import asyncio

import pytest

from yaied import SamplingParams
from yaied.core.config import load_config
from yaied.core.grammar_spec import make_spec
from yaied.core.request import FinishReason, TokenEvent
from yaied.core.stream import EventStream
from yaied.engine.async_engine import AsyncEngine
from yaied.worker.model_files import DEFAULT_MODEL_NAME

PROMPT = list(range(3, 40))


def make_engine(model: str, **overrides: object) -> AsyncEngine:
    config = load_config(
        overrides={
            "model": model,
            "dtype": "float32",
            "kv_cache_gib": 0.02,
            "max_num_batched_tokens": 32,
            **overrides,
        }
    )
    return AsyncEngine(config, show_progress=False)


@pytest.fixture(scope="module")
def engine(tiny_model_dirs):
    eng = make_engine(str(tiny_model_dirs["llama"]))
    yield eng
    eng._executor.shutdown()


async def run(
    engine: AsyncEngine, prompt, params: SamplingParams, output_ids=()
) -> list[TokenEvent]:
    events: EventStream[None] = EventStream()
    engine.add_request(prompt, params, sink=events.sink(None), output_ids=output_ids)
    return [event async for _, event in events]


def tokens(events: list[TokenEvent]) -> list[int]:
    return [t for event in events for t in event.token_ids]


@pytest.mark.parametrize(
    "knobs",
    [
        dict(temperature=0.0),
        dict(temperature=1.0, seed=7),  # the seeded draws' position carries over
        dict(temperature=0.8, top_k=20, seed=3, frequency_penalty=1.5, presence_penalty=0.5),
        dict(temperature=0.0, repetition_penalty=1.8, logprobs=3),
    ],
    ids=["greedy", "seeded", "penalties", "repetition-logprobs"],
)
async def test_a_resumed_call_goes_on_as_one_engine_would(engine, knobs):
    params = SamplingParams(max_tokens=24, ignore_eos=True, **knobs)
    whole = await run(engine, PROMPT, params)
    full = tokens(whole)
    assert len(full) == 24
    for k in (1, 9, 23):
        rest = await run(engine, PROMPT, params, output_ids=full[:k])
        assert tokens(rest) == full[k:], k
        last = rest[-1]
        assert last.finish_reason is FinishReason.LENGTH
        assert last.num_prompt_tokens == len(PROMPT) and last.num_output_tokens == 24
        if params.logprobs is not None:
            expected = [lp for event in whole for lp in event.logprobs][k:]
            got = [lp for event in rest for lp in event.logprobs]
            assert [lp.token_id for lp in got] == [lp.token_id for lp in expected]
            assert [lp.logprob for lp in got] == pytest.approx(
                [lp.logprob for lp in expected], abs=1e-5
            )
    assert engine.cache.num_free_pages == engine.pool.num_pages


async def test_min_tokens_counts_the_tokens_sent_before(engine):
    eos = sorted(engine.inputs.eos_token_ids)
    params = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=eos, min_tokens=5)
    whole = tokens(await run(engine, PROMPT, params))
    rest = await run(engine, PROMPT, params, output_ids=whole[:3])
    assert tokens(rest) == whole[3:]


@pytest.fixture(scope="module")
def default_engine():
    eng = make_engine(DEFAULT_MODEL_NAME, max_model_len=256, max_num_batched_tokens=128)
    yield eng
    eng._executor.shutdown()


def text_prompt(engine: AsyncEngine, text: str) -> list[int]:
    return engine.inputs.prompt_token_ids(text, SamplingParams())


@pytest.mark.slow
async def test_stop_strings_match_across_the_seam_and_no_text_is_lost(default_engine):
    prompt = text_prompt(default_engine, "The three primary colours are red, yellow and")
    free = tokens(await run(default_engine, prompt, SamplingParams(max_tokens=16, temperature=0)))
    decode = default_engine.tokenizer.decode
    # A stop string of three tokens' text: the first two are held back, so seams fall inside it.
    for j in range(1, 10):
        before, through = decode(free[:j]), decode(free[: j + 3])
        stop = through[len(before) :]
        if len(stop.strip()) >= 4 and through.find(stop) == len(before):
            break
    else:
        pytest.fail(f"no usable stop string in {decode(free)!r}")
    params = SamplingParams(max_tokens=16, temperature=0, stop=[stop])
    whole = await run(default_engine, prompt, params)
    assert whole[-1].finish_reason is FinishReason.STOP and whole[-1].stop_reason == stop
    assert whole[-2].text == "" and whole[-2].token_ids  # held back: a seam falls after it
    sent = 0
    for cut in range(1, len(tokens(whole))):  # every seam before the stop completed
        first = whole[:cut]  # one token an event: what the first engine sent before it went
        rest = await run(default_engine, prompt, params, output_ids=tokens(first))
        assert tokens(first) + tokens(rest) == tokens(whole)
        assert "".join(e.text for e in first + rest) == "".join(e.text for e in whole)
        assert rest[-1].finish_reason is FinishReason.STOP and rest[-1].stop_reason == stop
        sent += 1
    assert sent >= 3


@pytest.mark.slow
async def test_a_grammar_is_replayed_through_the_tokens_sent(default_engine):
    prompt = text_prompt(default_engine, "A JSON object about a city:")
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "rank": {"type": "integer"}},
        "required": ["city", "rank"],
    }
    spec = make_spec("json_schema", schema, "response_format")
    await default_engine.inputs.grammars.compile(spec)
    params = SamplingParams(max_tokens=40, temperature=0, structured=spec)
    whole = tokens(await run(default_engine, prompt, params))
    for k in (2, len(whole) // 2):
        rest = await run(default_engine, prompt, params, output_ids=whole[:k])
        assert tokens(rest) == whole[k:]
    # Output the grammar never allowed fails that call alone, with an error event.
    bad = default_engine.tokenizer.encode("not json", add_special_tokens=False)
    refused = await run(default_engine, prompt, params, output_ids=bad)
    assert [e.finish_reason for e in refused] == [FinishReason.ERROR]
    assert await asyncio.wait_for(run(default_engine, prompt, params), 60)
