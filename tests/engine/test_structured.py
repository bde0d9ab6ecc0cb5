"""Structured outputs through the engine, on the default model in fp32: the 22 realistic schemas
(greedy and seeded), regexes, choices and an EBNF grammar; unconstrained neighbours unchanged;
preemption in the middle of a constrained output; a refused token failing one request; the
knobs that meet a grammar (min_tokens, ignore_eos, stop strings, max_tokens, logprobs, seeds);
and an engine that compiles for itself (as an engine process does)."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest
import torch

from tests.structured.schemas import SCHEMA_CASES, example_messages
from yaied import LLM
from yaied.core.grammar_spec import GrammarSpec, make_spec
from yaied.core.request import FinishReason, SamplingParams, TokenEvent
from yaied.structured import SequenceMatcher
from yaied.worker.loader import resolve_dtype
from yaied.worker.model_files import DEFAULT_MODEL_NAME

pytestmark = pytest.mark.slow

# Numbers of at most three digits: asked for a number, a small model may write digits forever.
ARITH = 'root ::= e\ne ::= t (("+" | "-") t)*\nt ::= [0-9] [0-9]? [0-9]? | "(" e ")"'
CHOICES = ["positive", "negative", "neutral"]


@pytest.fixture(scope="module")
def llm():
    engine = LLM(
        DEFAULT_MODEL_NAME,
        dtype="float32",
        show_progress=False,
        max_model_len=1024,
        kv_cache_gib=0.5,
    )
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def llm_auto():
    """The default dtype (bf16 math where the CPU has bf16 dot products, else fp32 math over
    bf16 weights): five times faster here than float32's fp32 weights, for the tests that need
    no greedy parity or batch invariance."""
    engine = LLM(DEFAULT_MODEL_NAME, show_progress=False, max_model_len=1024, kv_cache_gib=0.5)
    yield engine
    engine.close()


def chat(llm: LLM, text: str) -> list[int]:
    return llm.engine.inputs.chat_prompt([{"role": "user", "content": text}])[0]


def schema_spec(name: str) -> GrammarSpec:
    case = next(case for case in SCHEMA_CASES if case.name == name)
    return make_spec("json_schema", case.schema, "response_format.json_schema.schema")


def is_arith(text: str) -> bool:
    """Whether text is a sentence of ARITH (recursive descent)."""
    pos = 0

    def term() -> bool:
        nonlocal pos
        if pos < len(text) and text[pos] == "(":
            pos += 1
            if not expr() or pos >= len(text) or text[pos] != ")":
                return False
            pos += 1
            return True
        start = pos
        while pos < len(text) and text[pos].isdigit():
            pos += 1
        return pos > start

    def expr() -> bool:
        nonlocal pos
        if not term():
            return False
        while pos < len(text) and text[pos] in "+-":
            pos += 1
            if not term():
                return False
        return True

    return expr() and pos == len(text)


# 11-13 s on an idle 2-core machine (44 requests of up to 512 tokens; a minute with fp32
# weights); five times that when the machine is shared.
@pytest.mark.timeout(600)
def test_every_schema_greedy_and_seeded_validates(llm_auto):
    """All 22 schemas twice (greedy, then sampled with a seed), submitted at once so that they
    batch: every output that stops validates, and at least 90% stop within 512 tokens."""
    llm = llm_auto
    prompts, params = [], []
    for sampling in ({"temperature": 0.0}, {"temperature": 0.8, "seed": 7}):
        for case in SCHEMA_CASES:
            prompts.append(llm.engine.inputs.chat_prompt(example_messages(case))[0])
            spec = make_spec("json_schema", case.schema, "guided_json")
            params.append(SamplingParams(max_tokens=512, structured=spec, **sampling))
    outputs = llm.generate(prompts, params)
    n = len(SCHEMA_CASES)
    for mode, chunk in (("greedy", outputs[:n]), ("seeded", outputs[n:])):
        stopped = 0
        for case, out in zip(SCHEMA_CASES, chunk, strict=True):
            assert out.finish_reason in (FinishReason.STOP, FinishReason.LENGTH), out.error
            if out.finish_reason is FinishReason.STOP:
                stopped += 1
                jsonschema.validate(json.loads(out.text), case.schema)
        assert stopped >= 0.9 * n, f"{mode}: only {stopped} of {n} outputs finished"


def test_regex_choice_and_grammar_outputs_match(llm):
    cases = [
        ("regex", r"\(\d{3}\) \d{3}-\d{4}", "Write a US phone number."),
        ("regex", r"\d{4}-\d{2}-\d{2}", "When did the first moon landing happen?"),
        ("choice", CHOICES, "Is 'I loved this film' positive, negative or neutral?"),
        ("grammar", ARITH, "Write an expression like 12+(7-3)."),
    ]
    prompts, params = [], []
    for sampling in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 3}):
        for kind, value, question in cases:
            prompts.append(chat(llm, question))
            spec = make_spec(kind, value, f"structured_outputs.{kind}")
            params.append(SamplingParams(max_tokens=64, structured=spec, **sampling))
    for out, (kind, value, _) in zip(llm.generate(prompts, params), cases * 2, strict=True):
        assert out.finish_reason is FinishReason.STOP, (kind, out.text, out.error)
        if kind == "regex":
            assert re.fullmatch(value, out.text), out.text
        elif kind == "choice":
            assert out.text in value
        else:
            assert is_arith(out.text), out.text


def test_unconstrained_rows_are_unchanged_by_constrained_neighbours(llm):
    free_prompts = [chat(llm, q) for q in ("Name three rivers.", "Count to ten.", "Say hello.")]
    free_params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * 2
    free_params.append(SamplingParams(max_tokens=24, temperature=0.9, seed=5, ignore_eos=True))
    alone = llm.generate(free_prompts, free_params)
    constrained = [
        (example_messages(case), case)
        for case in SCHEMA_CASES
        if case.name in ("person", "tool_call", "order")
    ]
    prompts = free_prompts + [llm.engine.inputs.chat_prompt(m)[0] for m, _ in constrained]
    params = free_params + [
        SamplingParams(max_tokens=64, temperature=0.0, structured=schema_spec(c.name))
        for _, c in constrained
    ]
    mixed = llm.generate(prompts, params)
    for single, together in zip(alone, mixed[:3], strict=True):
        assert together.token_ids == single.token_ids
    for out, (_, case) in zip(mixed[3:], constrained, strict=True):
        assert out.finish_reason is FinishReason.STOP
        jsonschema.validate(json.loads(out.text), case.schema)


def test_preemption_in_the_middle_of_a_constrained_output():
    """A pool of about 290 tokens for two requests of about 170: one is preempted while its
    output is half written, and recompute keeps the output and the matcher in step."""
    schema = {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 9},
        "minItems": 60,
        "maxItems": 60,
    }
    spec = make_spec("json_schema", schema, "guided_json")
    # The default dtype (bf16 weights, a few times faster than float32's); the pool holds about
    # 290 tokens whatever the KV cache's dtype: 12.8 MB of fp32, half that of bf16.
    kv_bytes = resolve_dtype("auto", torch.device("cpu")).itemsize
    with LLM(
        DEFAULT_MODEL_NAME,
        show_progress=False,
        max_model_len=256,
        kv_cache_gib=0.0125 * kv_bytes / 4,
    ) as small:
        prompt = chat(small, "List sixty digits as a JSON array.")
        params = [
            SamplingParams(max_tokens=200, temperature=0.7, seed=seed, structured=spec)
            for seed in range(2)
        ]
        outputs = small.generate([prompt] * 2, params)
        assert small.stats()["num_preemptions"] > 0
    for out in outputs:
        assert out.finish_reason is FinishReason.STOP, out.error
        jsonschema.validate(json.loads(out.text), schema)


def test_a_refused_token_fails_only_its_request(llm, monkeypatch):
    victim = make_spec("regex", r"[a-z]{5}[0-9]{5}", "guided_regex")
    accept = SequenceMatcher.accept

    def refuse_third(self: SequenceMatcher, token_id: int) -> bool:
        if self.compiled.spec == victim and self.num_accepted == 2:
            self.error = "refused on purpose"
            return False
        return accept(self, token_id)

    monkeypatch.setattr(SequenceMatcher, "accept", refuse_third)
    prompt = chat(llm, "Write a code.")
    params = [
        SamplingParams(max_tokens=32, temperature=0.0, structured=victim),
        SamplingParams(max_tokens=32, temperature=0.0, structured=schema_spec("sentiment")),
        SamplingParams(max_tokens=8, temperature=0.0),
    ]
    failed, neighbour, free = llm.generate([prompt] * 3, params)
    assert failed.finish_reason is FinishReason.ERROR and "refused on purpose" in failed.error
    assert len(failed.token_ids) == 2  # the refused token is never reported
    assert neighbour.finish_reason is FinishReason.STOP and json.loads(neighbour.text)
    assert free.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    assert llm.stats()["num_free_pages"] == llm.stats()["num_pages"]


def test_knobs_that_meet_a_grammar(llm):
    choice = make_spec("choice", CHOICES, "guided_choice")
    person = schema_spec("person")
    prompt = chat(llm, "Is 'what a dull day' positive, negative or neutral?")
    who = llm.engine.inputs.chat_prompt(example_messages(SCHEMA_CASES[0]))[0]
    params = [
        # min_tokens cannot outlast a grammar that has ended: EOS is then the only choice.
        SamplingParams(max_tokens=16, temperature=0.0, min_tokens=12, structured=choice),
        # Neither can ignore_eos: the grammar's end is a stop.
        SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True, structured=person),
        # max_tokens cuts the JSON short, as with every engine.
        SamplingParams(max_tokens=4, temperature=0.0, structured=person),
        # A stop string ends a constrained output like any other.
        SamplingParams(max_tokens=64, temperature=0.0, stop=['"age"'], structured=person),
        # Logprobs of a constrained row are over the grammar's tokens: no -inf alternatives.
        SamplingParams(max_tokens=16, temperature=0.0, logprobs=5, structured=choice),
        # n = 2 is two calls with a matcher each: seeds give two valid, reproducible outputs.
        SamplingParams(max_tokens=64, temperature=1.0, seed=1, structured=person),
        SamplingParams(max_tokens=64, temperature=1.0, seed=2, structured=person),
    ]
    prompts = [prompt, who, who, who, prompt, who, who]
    min_tokens, no_eos, short, stopped, logprobs, seed1, seed2 = llm.generate(prompts, params)
    assert min_tokens.finish_reason is FinishReason.STOP and min_tokens.text in CHOICES
    assert no_eos.finish_reason is FinishReason.STOP and json.loads(no_eos.text)
    assert short.finish_reason is FinishReason.LENGTH and len(short.token_ids) == 4
    assert short.text.startswith('{"name": ')
    assert stopped.finish_reason is FinishReason.STOP and stopped.stop_reason == '"age"'
    assert stopped.text.startswith('{"name": "') and stopped.text.endswith(", ")
    assert logprobs.text in CHOICES
    for entry in logprobs.logprobs:
        assert entry.logprob > float("-inf") and 1 <= len(entry.top_ids) <= 5
        assert all(lp > float("-inf") for lp in entry.top_logprobs)
    for out in (seed1, seed2):
        assert out.finish_reason is FinishReason.STOP
        jsonschema.validate(json.loads(out.text), SCHEMA_CASES[0].schema)
    again = llm.generate([who], params[5])[0]
    assert again.token_ids == seed1.token_ids


def test_an_engine_compiles_what_its_caller_did_not(llm):
    """An engine in another process has its own cache: add_request with an uncompiled spec
    waits for a compile task; one that does not compile fails its request alone, and an abort
    while compiling ends it with nothing left behind."""
    engine = llm.engine
    prompt = chat(llm, "Write three letters.")

    async def run(spec: GrammarSpec, abort: bool = False) -> list[TokenEvent]:
        events: list[TokenEvent] = []
        done = asyncio.Event()

        def sink(event: TokenEvent) -> None:
            events.append(event)
            if event.finished:
                done.set()

        params = SamplingParams(max_tokens=16, temperature=0.0, structured=spec)
        request_id = engine.add_request(prompt, params, sink=sink)
        if abort:
            engine.abort(request_id)
        await asyncio.wait_for(done.wait(), 60)
        return events

    fresh = make_spec("regex", r"[x-z]{3}", "guided_regex")
    assert engine.inputs.grammars.cached(fresh) is None
    events = llm._loop.run_until_complete(run(fresh))
    assert events[-1].finish_reason is FinishReason.STOP
    assert re.fullmatch(r"[x-z]{3}", "".join(e.text for e in events))
    bad = make_spec("regex", r"[unclosed", "guided_regex")
    events = llm._loop.run_until_complete(run(bad))
    assert events[-1].finish_reason is FinishReason.ERROR
    assert "invalid regular expression" in events[-1].error
    aborted = llm._loop.run_until_complete(run(make_spec("regex", r"[q-s]{4}", "r"), abort=True))
    assert [e.finish_reason for e in aborted] == [FinishReason.ABORT]
    assert engine.num_requests_in_flight == 0 and not engine._compiling
    stats = engine.stats()
    assert stats["num_free_pages"] == stats["num_pages"]
