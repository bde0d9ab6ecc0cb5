"""The request-field parser: every accepted form, the canonical key, and every error's param."""

from __future__ import annotations

import json

import pytest

from yaied.core.grammar_spec import (
    MAX_SCHEMA_DEPTH,
    MAX_SPEC_BYTES,
    GrammarSpec,
    StructuredOutputError,
    canonical_json_schema,
    make_spec,
    parse_structured_output,
)

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}


def test_no_constraint() -> None:
    assert parse_structured_output({}) is None
    assert parse_structured_output({"response_format": {"type": "text"}}) is None
    assert parse_structured_output({"response_format": None, "guided_json": None}) is None
    assert parse_structured_output({"structured_outputs": None}) is None


def test_response_format_forms() -> None:
    spec = parse_structured_output({"response_format": {"type": "json_object"}})
    assert spec == GrammarSpec("json_object", "")
    assert spec is not None and spec.param == "response_format"
    body = {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True, "description": "d"},
        }
    }
    spec = parse_structured_output(body)
    assert spec is not None and spec.kind == "json_schema"
    assert json.loads(spec.source) == SCHEMA
    assert spec.param == "response_format.json_schema.schema"


@pytest.mark.parametrize(
    ("field", "value", "kind"),
    [
        ("json", SCHEMA, "json_schema"),
        ("json", json.dumps(SCHEMA), "json_schema"),
        ("regex", r"\d+", "regex"),
        ("choice", ["yes", "no"], "choice"),
        ("grammar", 'root ::= "a"', "grammar"),
        ("json_object", True, "json_object"),
    ],
)
def test_structured_outputs_and_aliases(field: str, value: object, kind: str) -> None:
    spec = parse_structured_output({"structured_outputs": {field: value}})
    assert spec is not None and spec.kind == kind
    assert spec.param == f"structured_outputs.{field}"
    if field != "json_object":
        alias = parse_structured_output({f"guided_{field}": value})
        assert alias == spec and alias is not None and alias.param == f"guided_{field}"


def test_canonical_key() -> None:
    reordered = {
        "properties": {"b": {"type": "integer"}, "a": {"type": "string"}},
        "type": "object",
    }
    assert make_spec("json_schema", SCHEMA, "p").key == make_spec("json_schema", reordered, "p").key
    assert make_spec("json_schema", json.dumps(SCHEMA, indent=2), "p").key == (
        make_spec("json_schema", SCHEMA, "p").key
    )
    # Property order is the output order: it stays, and it is part of the key.
    swapped = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}}
    assert make_spec("json_schema", swapped, "p").key != make_spec("json_schema", SCHEMA, "p").key
    assert list(json.loads(canonical_json_schema(SCHEMA, "p"))["properties"]) == ["b", "a"]
    # Data keeps its order; keywords are sorted; no whitespace.
    text = canonical_json_schema({"type": "string", "enum": ["z", "a"]}, "p")
    assert text == '{"enum":["z","a"],"type":"string"}'
    # Kinds never collide, the param is not identity.
    assert make_spec("regex", "a", "x") == make_spec("regex", "a", "y")
    assert make_spec("regex", "a", "x").key != make_spec("grammar", "a", "x").key
    assert make_spec("choice", ["a", "b"], "x").source == '["a","b"]'


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": "json"}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": SCHEMA, "strict": "yes"},
                }
            },
            "response_format.json_schema.strict",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
            "response_format.json_schema.schema",
        ),
        ({"structured_outputs": []}, "structured_outputs"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"json_object": False}}, "structured_outputs"),
        ({"structured_outputs": {"jsn": {}}}, "structured_outputs.jsn"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice"),
        ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object"),
        ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": 3}}, "structured_outputs.grammar"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": ["a", 1]}, "guided_choice"),
        ({"guided_choice": "a"}, "guided_choice"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_json": "[1, 2]"}, "guided_json"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"structured_outputs": {"regex": "a"}, "guided_regex": "a"}, "guided_regex"),
    ],
)
def test_errors_name_the_field(body: dict, param: str) -> None:
    with pytest.raises(StructuredOutputError) as info:
        parse_structured_output(body)
    assert info.value.param == param
    assert isinstance(info.value, ValueError) and str(info.value)


def test_size_and_depth_limits() -> None:
    big = {"type": "string", "enum": ["x" * 1000 for _ in range(MAX_SPEC_BYTES // 1000 + 1)]}
    with pytest.raises(StructuredOutputError, match="over the limit") as info:
        parse_structured_output({"guided_json": big})
    assert info.value.param == "guided_json"
    with pytest.raises(StructuredOutputError, match="over the limit"):
        make_spec("regex", "a" * (MAX_SPEC_BYTES + 1), "guided_regex")
    make_spec("regex", "a" * MAX_SPEC_BYTES, "guided_regex")  # the limit itself is fine
    deep: dict = {"type": "string"}
    for _ in range(MAX_SCHEMA_DEPTH):
        deep = {"type": "array", "items": deep}
    with pytest.raises(StructuredOutputError, match="nested deeper"):
        make_spec("json_schema", deep, "guided_json")
    with pytest.raises(ValueError, match="unknown grammar kind"):
        GrammarSpec("xml", "")  # type: ignore[arg-type]
