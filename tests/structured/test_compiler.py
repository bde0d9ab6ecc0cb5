"""GrammarCompiler with the default model's tokenizer: every schema case, the other spec kinds,
compiler errors, the byte-bounded cache, timeouts and deduplicated concurrent compiles."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import json
import threading
from collections.abc import Callable
from typing import Any

import pytest

from tests.structured.schemas import SCHEMA_CASES, SchemaCase
from yaied.core.grammar_spec import GrammarSpec
from yaied.structured import GrammarCompiler, SequenceMatcher, StructuredOutputError, make_spec
from yaied.structured.compiler import CompiledGrammar


def runs_to_stop(compiled: CompiledGrammar, token_ids: list[int], eos: int) -> bool:
    """Whether a matcher accepts every token and then terminates on EOS."""
    matcher = SequenceMatcher.create(compiled)
    return matcher.accept_tokens([*token_ids, eos]) and matcher.is_terminated


def test_at_least_20_schemas() -> None:
    assert len(SCHEMA_CASES) >= 20
    assert len({case.name for case in SCHEMA_CASES}) == len(SCHEMA_CASES)


@pytest.mark.parametrize("case", SCHEMA_CASES, ids=lambda case: case.name)
def test_schema_case(
    case: SchemaCase, compiler: GrammarCompiler, tokenizer: Any, encode: Callable
) -> None:
    compiled = compiler.compile(make_spec("json_schema", case.schema, "guided_json"))
    assert compiled.memory_bytes > 0
    for instance in case.valid:
        assert runs_to_stop(compiled, encode(json.dumps(instance)), tokenizer.eos_token_id), (
            instance
        )
    for instance in case.invalid:
        matcher = SequenceMatcher.create(compiled)
        ids = [*encode(json.dumps(instance)), tokenizer.eos_token_id]
        assert not matcher.accept_tokens(ids) or not matcher.is_terminated, instance
        assert matcher.failed and "not allowed" in (matcher.error or "")


def test_regex_choice_grammar(compiler: GrammarCompiler, tokenizer: Any, encode: Callable) -> None:
    eos = tokenizer.eos_token_id
    phone = compiler.compile(make_spec("regex", r"\(\d{3}\) \d{3}-\d{4}", "guided_regex"))
    assert runs_to_stop(phone, encode("(555) 123-4567"), eos)
    assert not runs_to_stop(phone, encode("555-123-4567"), eos)
    choices = ["yes", "no", 'say "maybe"', "naïve\\path\n"]
    choice = compiler.compile(make_spec("choice", choices, "guided_choice"))
    for text in choices:
        assert runs_to_stop(choice, encode(text), eos), text
    assert not runs_to_stop(choice, encode("nope"), eos)
    assert not runs_to_stop(choice, encode("ye"), eos)
    ebnf = 'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= [0-9]+ | "(" expr ")"'
    arithmetic = compiler.compile(make_spec("grammar", ebnf, "guided_grammar"))
    assert runs_to_stop(arithmetic, encode("(1+23)-4"), eos)
    assert not runs_to_stop(arithmetic, encode("1+"), eos)
    assert not runs_to_stop(arithmetic, encode("(1"), eos)


def test_all_of_object_schemas_merge(
    compiler: GrammarCompiler, tokenizer: Any, encode: Callable
) -> None:
    """An allOf of several object schemas (inline or $ref) is enforced as their merge; xgrammar
    alone compiles it to any JSON value, so a bare string or a missing property got through."""
    eos = tokenizer.eos_token_id
    schema = {
        "$defs": {"Named": {"type": "object", "properties": {"name": {"type": "string"}}}},
        "allOf": [
            {"$ref": "#/$defs/Named"},
            {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]},
        ],
    }
    compiled = compiler.compile(make_spec("json_schema", schema, "p"))
    assert runs_to_stop(compiled, encode('{"name": "Ada", "age": 36}'), eos)
    assert runs_to_stop(compiled, encode('{"age": 36}'), eos)
    for invalid in ['"Ada"', '{"name": "Ada"}', '{"age": "x"}', "[1]"]:
        assert not runs_to_stop(compiled, encode(invalid), eos), invalid
    # one member beside the schema's own properties: both hold
    schema = {
        "$defs": schema["$defs"],
        "type": "object",
        "allOf": [{"$ref": "#/$defs/Named"}],
        "properties": {"age": {"type": "integer"}},
        "required": ["age"],
    }
    compiled = compiler.compile(make_spec("json_schema", schema, "p"))
    assert runs_to_stop(compiled, encode('{"name": "Ada", "age": 36}'), eos)
    assert not runs_to_stop(compiled, encode('{"name": "Ada"}'), eos)


def test_schema_strict_mode_falls_back(
    compiler: GrammarCompiler, tokenizer: Any, encode: Callable
) -> None:
    """Unnamed properties are refused (strict) unless the schema then has no instance at all."""
    eos = tokenizer.eos_token_id
    named = compiler.compile(make_spec("json_schema", {"type": "object", "properties": {}}, "p"))
    assert runs_to_stop(named, encode("{}"), eos)
    free = compiler.compile(make_spec("json_schema", {"type": "object", "minProperties": 1}, "p"))
    assert runs_to_stop(free, encode('{"x": 1}'), eos)
    assert not runs_to_stop(free, encode("{}"), eos)


async def test_many_distinct_compiles_at_once(make_compiler: Callable) -> None:
    comp: GrammarCompiler = make_compiler(max_workers=2)
    specs = [make_spec("json_schema", case.schema, "p") for case in SCHEMA_CASES[:8]]
    specs += [make_spec("regex", f"[a-z]{{{n}}}", "p") for n in range(1, 9)]
    results = await asyncio.gather(*(comp.compile_async(spec) for spec in specs))
    assert [result.spec for result in results] == specs
    assert comp.stats.compiles == comp.stats.misses == len(specs)


def test_json_object_whitespace_is_bounded(
    compiler: GrammarCompiler, make_compiler: Callable, tokenizer: Any, encode: Callable
) -> None:
    eos = tokenizer.eos_token_id
    compiled = compiler.compile(make_spec("json_object", None, "response_format"))
    assert runs_to_stop(compiled, encode(json.dumps({"a": [1, {"b": None}], "c": "x y"})), eos)
    assert not runs_to_stop(compiled, encode("[1, 2]"), eos)  # an object, not any JSON
    for loose in ['{ "a": 1}', '{"a":  1}', '{"a": 1}\n', '{\n"a": 1}']:
        assert not runs_to_stop(compiled, encode(loose), eos), loose
    # After "{", no token that starts with whitespace is allowed: no loop on blanks.
    matcher = SequenceMatcher.create(compiled)
    assert matcher.accept_tokens(encode("{"))
    for blank in [" ", "  ", "\n", "\t", "    "]:
        probe = SequenceMatcher.create(compiled)
        assert probe.accept_tokens(encode("{"))
        assert not probe.accept_tokens(encode(blank)), repr(blank)
    # An opt-in bound: up to n whitespace characters between tokens.
    loose_compiler = make_compiler(max_json_whitespace=2)
    loose = loose_compiler.compile(make_spec("json_object", None, "response_format"))
    assert runs_to_stop(loose, encode('{ "a" :  1}'), eos)
    assert not runs_to_stop(loose, encode('{   "a": 1}'), eos)


def test_special_tokens_are_never_text(compiler: GrammarCompiler, tokenizer: Any) -> None:
    """<|im_start|> inside a JSON string or a free regex would be dropped by the detokenizer."""
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    anything = compiler.compile(make_spec("regex", ".*", "guided_regex"))
    matcher = SequenceMatcher.create(anything)
    assert not matcher.accept(im_start)
    assert SequenceMatcher.create(anything).accept(tokenizer.eos_token_id)  # the stop token ends it
    assert compiler.stop_token_ids == [tokenizer.eos_token_id]


def test_padded_vocab_rows_are_never_allowed(tokenizer: Any, vocab_size: int) -> None:
    padded = GrammarCompiler(tokenizer, vocab_size + 64)
    try:
        from yaied.structured import allocate_bitmask

        compiled = padded.compile(make_spec("regex", ".*", "guided_regex"))
        bitmask = allocate_bitmask(1, vocab_size + 64)
        SequenceMatcher.create(compiled).fill_bitmask(bitmask, 0)
        assert bitmask.host.shape[1] == (vocab_size + 64 + 31) // 32
        assert int(bitmask.host[0, vocab_size // 32 :].count_nonzero()) == 0
        assert not SequenceMatcher.create(compiled).accept(vocab_size + 3)
    finally:
        padded.close()


@pytest.mark.parametrize(
    ("kind", "value", "reason"),
    [
        ("json_schema", {"type": "foo"}, "invalid JSON schema: Unsupported type"),
        ("json_schema", {"$ref": "#/$defs/Missing"}, "invalid JSON schema"),
        ("json_schema", {"type": "integer", "minimum": 5, "maximum": 1}, "invalid JSON schema"),
        ("regex", "(ab", "invalid regular expression: Regex parsing error"),
        ("regex", "[z-a]", "invalid regular expression"),
        ("grammar", "root ::= undefined_rule", "invalid grammar: EBNF parser error"),
        ("grammar", 'start ::= "a"', "invalid grammar"),
    ],
)
async def test_invalid_specs_carry_param_and_reason(
    compiler: GrammarCompiler, kind: Any, value: object, reason: str
) -> None:
    spec = make_spec(kind, value, "structured_outputs.x")
    with pytest.raises(StructuredOutputError) as sync_error:
        compiler.compile(spec)
    assert sync_error.value.param == "structured_outputs.x"
    assert sync_error.value.message.startswith(reason)
    assert "/project/cpp" not in sync_error.value.message  # no C++ source locations
    # The same spec from another field: the error names the field it came from.
    other = GrammarSpec(spec.kind, spec.source, "guided_x")
    with pytest.raises(StructuredOutputError) as async_error:
        await compiler.compile_async(other)
    assert async_error.value.param == "guided_x"
    assert compiler.cached(spec) is None  # errors are not cached


async def test_cache_hits_misses_and_byte_bound(make_compiler: Callable) -> None:
    seen: list[float] = []
    comp: GrammarCompiler = make_compiler(on_compile=seen.append)
    a, b, c = (make_spec("regex", f"{ch}{{2,6}}", "guided_regex") for ch in "abc")
    compiled_a = comp.compile(a)
    assert comp.compile(a) is compiled_a
    assert await comp.compile_async(a) is compiled_a
    assert (comp.stats.misses, comp.stats.hits, comp.stats.compiles) == (1, 2, 1)
    assert len(seen) == 1 and seen[0] == compiled_a.compile_seconds > 0
    compiled_b, compiled_c = comp.compile(b), comp.compile(c)
    total = compiled_a.memory_bytes + compiled_b.memory_bytes + compiled_c.memory_bytes
    assert comp.stats.cache_bytes == total and comp.stats.cache_entries == 3

    # A cache that holds any two of them but not all three: least recently used goes first.
    small = make_compiler(cache_limit_bytes=total - 1)
    small.compile(a), small.compile(b)
    assert small.cached(a) is not None  # a is now the most recently used
    small.compile(c)
    assert small.cached(b) is None and small.cached(a) is not None and small.cached(c) is not None
    assert small.stats.evictions == 1 and small.stats.cache_bytes <= total - 1
    # An entry larger than the whole cache is returned but never kept.
    tiny = make_compiler(cache_limit_bytes=16)
    assert tiny.compile(a).grammar is not None
    assert tiny.cached(a) is None and tiny.stats.cache_bytes == 0


_MALLINFO2_FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks")
_MALLINFO2_FIELDS += ("uordblks", "fordblks", "keepcost")


def _heap_in_use() -> int | None:
    """glibc's bytes in use by malloc, every arena (mallinfo2); None elsewhere."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallinfo2 = libc.mallinfo2
    except (OSError, AttributeError):
        return None

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in _MALLINFO2_FIELDS]

    mallinfo2.restype = MallInfo2
    info = mallinfo2()
    return info.uordblks + info.hblkhd  # small chunks in use plus mmapped ones


def _schema_of_ten(i: int) -> dict[str, Any]:
    kinds = [
        {"type": "string"},
        {"type": "integer"},
        {"type": "number"},
        {"type": "boolean"},
        {"enum": [f"red{i}", f"green{i}", f"blue{i}"]},
        {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        {"type": "object", "properties": {f"x{i}": {"type": "integer"}}, "required": []},
    ]
    props = {f"field{i}_{k}": kinds[(i + k) % len(kinds)] for k in range(10)}
    return {"type": "object", "properties": props, "required": list(props)[:5]}


def test_the_cache_accounts_for_the_heap_its_entries_hold(make_compiler: Callable) -> None:
    """The byte bound holds in memory: xgrammar's memory_size_bytes counts its containers'
    sizes, not their capacity nor malloc's headers, and a held schema of ten properties took
    1.26x that (glibc in-use bytes), past a bound that counted only it."""
    if _heap_in_use() is None:
        pytest.skip("needs glibc's mallinfo2")
    comp: GrammarCompiler = make_compiler()
    specs = [make_spec("json_schema", _schema_of_ten(i), "guided_json") for i in range(25)]
    comp.compile(specs[0])  # the pool thread, its arena and xgrammar's first-use state
    for spec in specs[1:]:
        comp.compile(spec)
    assert comp.stats.cache_entries == 25
    # What the entries hold is what clearing the cache gives back: read over a moment, so a
    # thread another test left running hardly moves the process-wide counter.
    accounted = comp.stats.cache_bytes
    gc.collect()
    full = _heap_in_use()
    comp.clear_cache()
    gc.collect()
    held = full - _heap_in_use()
    assert held <= accounted, (held, accounted)
    # ... and not wildly more: the bound still lets the cache hold what it is sized for.
    assert accounted < 2 * held


def _blocking_compiles(comp: GrammarCompiler, monkeypatch: pytest.MonkeyPatch):
    """Make comp's compiles wait for `release`; `calls` lists the keys compiled."""
    release, started = threading.Event(), threading.Event()
    calls: list[str] = []
    real = comp._compile_uncached

    def slow(spec: GrammarSpec) -> CompiledGrammar:
        calls.append(spec.source)
        started.set()
        assert release.wait(10)
        return real(spec)

    monkeypatch.setattr(comp, "_compile_uncached", slow)
    return release, started, calls


async def test_compile_timeout(make_compiler: Callable, monkeypatch: pytest.MonkeyPatch) -> None:
    comp: GrammarCompiler = make_compiler(timeout_s=0.05)
    release, started, calls = _blocking_compiles(comp, monkeypatch)
    spec = make_spec("regex", "slow+", "structured_outputs.regex")
    with pytest.raises(StructuredOutputError, match="longer than 0.05 s") as info:
        await comp.compile_async(spec)
    assert info.value.param == "structured_outputs.regex" and comp.stats.timeouts == 1
    release.set()  # the compile that ran on finishes in the background and is cached
    for _ in range(200):
        if comp.cached(spec) is not None:
            break
        await asyncio.sleep(0.01)
    assert await comp.compile_async(spec) is not None and calls == ["slow+"]


async def test_queued_compile_nobody_waits_for_is_dropped(
    make_compiler: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    comp: GrammarCompiler = make_compiler(max_workers=1)
    release, started, calls = _blocking_compiles(comp, monkeypatch)
    first = asyncio.ensure_future(comp.compile_async(make_spec("regex", "first", "p")))
    await asyncio.to_thread(started.wait, 10)
    with pytest.raises(StructuredOutputError):
        await comp.compile_async(make_spec("regex", "queued", "p"), timeout_s=0.05)
    release.set()
    assert (await first).spec.source == "first"
    await asyncio.sleep(0.05)
    assert calls == ["first"] and not comp._inflight


async def test_concurrent_compiles_share_one(
    make_compiler: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    comp: GrammarCompiler = make_compiler()
    release, started, calls = _blocking_compiles(comp, monkeypatch)
    spec = make_spec("json_schema", SCHEMA_CASES[0].schema, "guided_json")
    waiters = [asyncio.ensure_future(comp.compile_async(spec)) for _ in range(5)]
    await asyncio.to_thread(started.wait, 10)
    # One waiter leaving (client gone) does not cancel the compile the others share.
    waiters[0].cancel()
    release.set()
    results = await asyncio.gather(*waiters[1:])
    assert all(result is results[0] for result in results)
    assert calls == [spec.source]
    assert (comp.stats.misses, comp.stats.joined, comp.stats.compiles) == (1, 4, 1)
    assert comp.cached(spec) is results[0]


def test_compile_threads_run_torch_serially(compiler):
    # They live as long as the engine: a parallel torch op there would start an OpenMP team that
    # slows every engine step (yaied/engine/threads.py).
    import torch

    assert compiler._pool.submit(torch.get_num_threads).result() == 1


@pytest.mark.parametrize(
    ("schema", "valid", "invalid"),
    [
        ({"type": "object", "required": ["a"]}, ['{"a": 1}', '{"a": "x"}'], ["{}"]),
        (
            {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["a"]},
            ['{"b": 1, "a": [true]}', '{"a": null}'],
            ["{}", '{"b": 1}'],
        ),
        (
            {"type": "object", "additionalProperties": {"type": "integer"}, "required": ["a"]},
            ['{"a": 1}'],
            ["{}", '{"a": "x"}'],
        ),
    ],
)
def test_a_required_property_the_schema_does_not_name_is_written(
    compiler: GrammarCompiler, tokenizer: Any, encode: Callable, schema, valid, invalid
) -> None:
    """A name in `required` but not in `properties` may hold any value (or what
    additionalProperties allows); xgrammar wrote objects without it, which the schema refuses."""
    compiled = compiler.compile(make_spec("json_schema", schema, "p"))
    for text in valid:
        assert runs_to_stop(compiled, encode(text), tokenizer.eos_token_id), text
    for text in invalid:
        assert not runs_to_stop(compiled, encode(text), tokenizer.eos_token_id), text


def test_a_required_property_additional_properties_forbid_is_a_400(
    compiler: GrammarCompiler,
) -> None:
    """No object has it, so the schema has no instance: xgrammar wrote {} all the same."""
    schema = {"type": "object", "required": ["a"], "additionalProperties": False}
    with pytest.raises(StructuredOutputError, match="'a'"):
        compiler.compile(make_spec("json_schema", schema, "response_format.json_schema.schema"))


@pytest.mark.parametrize(
    "ref", ["http://example.com/schema.json", "other.json#/$defs/A", "#anchor", "urn:x"]
)
def test_a_ref_outside_the_schema_is_a_400(compiler: GrammarCompiler, ref: str) -> None:
    """Nothing outside the schema is fetched: xgrammar logged a warning and let any value through
    in its place (`null` came back for {"$ref": "http://..."})."""
    schema = {"type": "object", "properties": {"a": {"$ref": ref}}, "required": ["a"]}
    with pytest.raises(StructuredOutputError, match="only"):
        compiler.compile(make_spec("json_schema", schema, "response_format.json_schema.schema"))
    with pytest.raises(StructuredOutputError, match="only"):
        compiler.compile(make_spec("json_schema", {"$ref": ref}, "p"))


@pytest.mark.parametrize("pattern", ["^(?=a).*$", "^(?!x).*$", "^(?=.*[0-9]).{3,}$"])
def test_a_lookahead_in_a_pattern_is_a_400_as_in_a_regex(
    compiler: GrammarCompiler, pattern: str
) -> None:
    """xgrammar refuses a lookahead in a `regex` constraint but dropped it from a schema's
    `pattern`, so "xb" passed ^(?=a).*$: the same 400 now, rather than a pattern half kept."""
    with pytest.raises(StructuredOutputError, match="not supported"):
        compiler.compile(make_spec("regex", pattern, "guided_regex"))
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": pattern}}}
    with pytest.raises(StructuredOutputError, match="lookahead"):
        compiler.compile(make_spec("json_schema", schema, "p"))


@pytest.mark.parametrize("pattern", [r"^\(?=a$", "^[(?=]+$", r"^a\\(b)$"])
def test_what_only_looks_like_a_lookahead_compiles(compiler: GrammarCompiler, pattern: str):
    compiler.compile(make_spec("json_schema", {"type": "string", "pattern": pattern}, "p"))


def test_check_spec_refuses_what_a_compile_refuses_without_the_vocabulary() -> None:
    """check_spec tells which part of a spec that did not compile is at fault (a request's
    tools: one structural tag holds every tool's schema)."""
    from yaied.structured import check_spec

    check_spec(make_spec("json_schema", {"type": "object", "minProperties": 1}, "p"))  # retried
    check_spec(make_spec("regex", "[a-c]+", "p"))
    for kind, value, words in [
        ("json_schema", {"type": "foo"}, 'invalid JSON schema: Unsupported type "foo"'),
        ("json_schema", {"$ref": "https://x.test/s.json"}, "invalid JSON schema: $ref"),
        ("regex", "(unclosed", "invalid regular expression"),
    ]:
        with pytest.raises(StructuredOutputError) as info:
            check_spec(make_spec(kind, value, "tools[3].function.parameters"))
        assert info.value.param == "tools[3].function.parameters"
        assert info.value.message.startswith(words) and "[" not in info.value.message[:20]
