"""The structural tags tool calling and reasoning run under: compiled for the default model's
tokenizer, they accept what the parser reads back as valid calls and refuse what it would not."""

from __future__ import annotations

import json

import pytest

from yaied.core.grammar_spec import make_spec
from yaied.tools import FORMATS, get_format, parse_tool_calls
from yaied.tools.grammar import Tool, ToolChoice, output_structural_tag

xgr = pytest.importorskip("xgrammar")

WEATHER = Tool(
    "get_weather",
    "Weather in a city",
    {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
    },
)
CLOCK = Tool("get_time")  # no parameters: the arguments are {}
TOOLS = [WEATHER, CLOCK]


@pytest.fixture(scope="module")
def compiler(default_model_tokenizer, default_model_folder):
    from yaied.structured import GrammarCompiler

    vocab = json.loads((default_model_folder / "config.json").read_text())["vocab_size"]
    compiler = GrammarCompiler(default_model_tokenizer, vocab)
    yield compiler
    compiler.close()


def accepts(compiler, tag: dict, text: str) -> bool:
    """Whether the grammar takes `text` whole and may then end (EOS)."""
    compiled = compiler.compile(make_spec("structural_tag", tag, "tools"))
    matcher = xgr.GrammarMatcher(compiled.grammar)
    if not matcher.accept_string(text):
        return False
    return matcher.accept_token(compiler.stop_token_ids[0])


def call(fmt: str, name: str, arguments: dict) -> str:
    return get_format(fmt).render_call(name, arguments)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_required_is_calls_only_with_valid_arguments(compiler, fmt):
    tag = output_structural_tag(tool_format=fmt, tools=TOOLS, choice=ToolChoice("required"))
    good = call(fmt, "get_weather", {"city": "Paris", "unit": "c"})
    assert accepts(compiler, tag, good)
    assert accepts(compiler, tag, call(fmt, "get_time", {}))
    two = get_format(fmt).call_joiner.join([good, call(fmt, "get_time", {})])
    assert accepts(compiler, tag, two)  # parallel calls, joined as the family joins them
    parsed = parse_tool_calls(two, fmt, tool_names=["get_weather", "get_time"])
    assert [c.name for c in parsed.tool_calls] == ["get_weather", "get_time"]
    assert not accepts(compiler, tag, "Sure! " + good)  # no text around the calls
    assert not accepts(compiler, tag, "")  # at least one call
    assert not accepts(compiler, tag, call(fmt, "get_weather", {"city": "Paris", "unit": "k"}))
    assert not accepts(compiler, tag, call(fmt, "get_weather", {"city": "Paris"}))
    assert not accepts(compiler, tag, call(fmt, "rm_rf", {}))


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_named_function_is_one_call_of_it(compiler, fmt):
    choice = ToolChoice("required", "get_time")
    tag = output_structural_tag(tool_format=fmt, tools=TOOLS, choice=choice)
    one = call(fmt, "get_time", {})
    assert accepts(compiler, tag, one)
    assert not accepts(compiler, tag, call(fmt, "get_weather", {"city": "a", "unit": "c"}))
    assert not accepts(compiler, tag, get_format(fmt).call_joiner.join([one, one]))


def test_auto_allows_text_and_forces_calls_once_opened(compiler):
    tag = output_structural_tag(tool_format="hermes", tools=TOOLS, choice=ToolChoice("auto"))
    good = call("hermes", "get_weather", {"city": "Paris", "unit": "f"})
    assert accepts(compiler, tag, "It is sunny.")
    assert accepts(compiler, tag, "Let me look. " + good)
    assert accepts(compiler, tag, good + "\n" + call("hermes", "get_time", {}))
    assert not accepts(compiler, tag, '<tool_call>\n{"name": "get_weather", "arguments": {}}')
    single = output_structural_tag(
        tool_format="hermes", tools=TOOLS, choice=ToolChoice("auto"), parallel=False
    )
    assert accepts(compiler, single, good)
    assert not accepts(compiler, single, good + "\n" + good)


def test_none_and_plain_constraints_need_no_structural_tag():
    none = ToolChoice("none")
    assert output_structural_tag(tool_format="hermes", tools=TOOLS, choice=none) is None
    assert output_structural_tag(tool_format="hermes") is None
    schema = make_spec("json_schema", {"type": "object"}, "response_format")
    assert output_structural_tag(tool_format="hermes", constraint=schema) is None


def test_auto_with_response_format_is_calls_or_the_format(compiler):
    answer = make_spec(
        "json_schema",
        {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
        "response_format",
    )
    tag = output_structural_tag(
        tool_format="hermes", tools=TOOLS, choice=ToolChoice("auto"), constraint=answer
    )
    assert accepts(compiler, tag, '{"ok": true}')
    assert accepts(compiler, tag, call("hermes", "get_time", {}))
    assert not accepts(compiler, tag, "free text")


@pytest.mark.parametrize("starts_inside", [False, True])
def test_reasoning_comes_first_and_the_constraint_after_it(compiler, starts_inside):
    tag = output_structural_tag(
        tool_format="hermes", tools=TOOLS, choice=ToolChoice("required"), reasoning=starts_inside
    )
    good = call("hermes", "get_time", {})
    thought = "maybe <tool_call> is wrong here</think>\n\n"
    opened = thought if starts_inside else "<think>" + thought
    assert accepts(compiler, tag, opened + good)
    assert accepts(compiler, tag, good) is (not starts_inside)  # thinking is optional unless begun
    assert not accepts(compiler, tag, opened + "text " + good)
    choice = make_spec("choice", ["yes", "no"], "structured_outputs.choice")
    tag = output_structural_tag(tool_format="hermes", constraint=choice, reasoning=starts_inside)
    assert accepts(compiler, tag, opened + "yes")
    assert not accepts(compiler, tag, opened + "maybe")


def test_a_tool_without_parameters_takes_an_empty_object(compiler):
    tag = output_structural_tag(
        tool_format="hermes", tools=[CLOCK], choice=ToolChoice("required", "get_time")
    )
    assert accepts(compiler, tag, call("hermes", "get_time", {}))
    assert not accepts(compiler, tag, call("hermes", "get_time", {"tz": "UTC"}))


# What pydantic writes for a model that extends another (openai.pydantic_function_tool of it).
EXTENDED = {
    "$defs": {
        "Base": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        "Ext": {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]},
    },
    "allOf": [{"$ref": "#/$defs/Base"}, {"$ref": "#/$defs/Ext"}],
    "additionalProperties": False,
}


def test_an_all_of_in_tool_parameters_is_enforced_as_the_merge(compiler):
    """The arguments' schema gets what a response_format's does: xgrammar alone compiles an allOf
    of two objects to any JSON value, so the model wrote arrays as arguments, the parser could not
    read the call, and its markup came back as `content` with finish_reason stop."""
    tool = Tool("f", None, EXTENDED)
    tag = output_structural_tag(tool_format="hermes", tools=[tool], choice=ToolChoice("required"))
    assert accepts(compiler, tag, call("hermes", "f", {"a": 1, "b": "x"}))
    for bad in ([1, 2], {"a": 1}, {"b": "x"}, {"a": "x", "b": "x"}):
        assert not accepts(compiler, tag, call("hermes", "f", bad)), bad
    # and a response_format beside tools under auto (the `or` of calls and the answer)
    answer = make_spec("json_schema", EXTENDED, "response_format.json_schema.schema")
    tag = output_structural_tag(tool_format="hermes", tools=[tool], constraint=answer)
    assert accepts(compiler, tag, '{"a": 1, "b": "x"}')
    assert not accepts(compiler, tag, "[1, 2]")


def test_a_required_name_the_parameters_do_not_list_must_be_written(compiler):
    """{"type": "object", "required": ["city"]}: xgrammar wrote {} (no named property, strict),
    which the schema refuses."""
    tool = Tool("f", None, {"type": "object", "required": ["city"]})
    tag = output_structural_tag(tool_format="hermes", tools=[tool], choice=ToolChoice("required"))
    assert accepts(compiler, tag, call("hermes", "f", {"city": "Paris"}))
    assert not accepts(compiler, tag, call("hermes", "f", {}))


def test_a_pattern_or_reference_a_tool_cannot_enforce_passes_with_a_warning(compiler, caplog):
    # A response_format's own schema is refused for these (tests/structured/test_compiler.py);
    # a tool's schema often comes from elsewhere (an MCP server) and the tool may never be
    # called, so the request goes on: the rest of the schema is enforced, the log says what not.
    password = {"type": "string", "pattern": "^(?=.*[0-9]).{8,}$"}
    elsewhere = {"$ref": "https://example.com/address.json"}
    properties = {"password": password, "address": elsewhere}
    tool = Tool("sign_up", None, {"type": "object", "properties": properties})
    tag = output_structural_tag(tool_format="hermes", tools=[tool], choice=ToolChoice("auto"))
    with caplog.at_level("WARNING", logger="yaied.structured.schema_prepare"):
        assert accepts(compiler, tag, "Fine.")
    warnings = " ".join(r.getMessage() for r in caplog.records)
    assert "lookahead" in warnings and "example.com" in warnings
