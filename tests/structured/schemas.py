"""Realistic JSON schemas for structured-output tests, each with valid and invalid instances.

Pure data (and the few-shot chat that asks for an instance), reused by the compiler/matcher tests
here, by end-to-end tests through the engine and the server, and by scripts/bench_structured.py.
The schemas are what clients send: hand-written ones and pydantic v2's `model_json_schema()`
output (``$defs``/``$ref``, ``title``, ``anyOf`` with null for Optional, ``additionalProperties:
false`` as the openai SDK's ``parse()`` adds). Valid instances list their properties in the
schema's order (the order a grammar makes the model write them) and serialise with
``json.dumps`` defaults, the one-line form the compiler allows by default. Every invalid
instance breaks the schema in a way a grammar can see (a type, an enum, a required or unknown
property, a bound on items or string length, a pattern), and fails `jsonschema` validation too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class SchemaCase:
    name: str
    schema: dict[str, Any]
    valid: list[Any]
    invalid: list[Any] = field(default_factory=list)


def _obj(properties: dict[str, Any], required: list[str] | None = None, **extra: Any) -> dict:
    """An object schema; every property is required unless `required` says otherwise."""
    required = list(properties) if required is None else required
    return {"type": "object", "properties": properties, "required": required, **extra}


_STR = {"type": "string"}
_INT = {"type": "integer"}
_NUM = {"type": "number"}
_BOOL = {"type": "boolean"}
_NULLABLE_STR = {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None}

SCHEMA_CASES: list[SchemaCase] = [
    SchemaCase(
        "person",
        _obj({"name": _STR, "age": {"type": "integer", "minimum": 0, "maximum": 150}}),
        [{"name": "Ada Lovelace", "age": 36}, {"name": "", "age": 0}],
        [{"name": "Ada"}, {"name": "Ada", "age": "36"}, {"name": "Ada", "age": -1}],
    ),
    SchemaCase(
        "address",
        _obj(
            {
                "street": _STR,
                "city": _STR,
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "country": {"type": "string", "enum": ["US", "DE", "FR", "JP"]},
            },
            additionalProperties=False,
        ),
        [{"street": "1 Main St", "city": "Springfield", "zip": "12345", "country": "US"}],
        [
            {"street": "1 Main St", "city": "Springfield", "zip": "1234", "country": "US"},
            {"street": "1 Main St", "city": "Springfield", "zip": "12345", "country": "UK"},
        ],
    ),
    SchemaCase(
        "order",
        _obj(
            {
                "order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
                "items": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 3,
                    "items": _obj({"sku": _STR, "quantity": {"type": "integer", "minimum": 1}}),
                },
                "status": {"type": "string", "enum": ["pending", "shipped", "delivered"]},
            }
        ),
        [
            {
                "order_id": "ORD-000123",
                "items": [{"sku": "A1", "quantity": 2}],
                "status": "pending",
            },
            {
                "order_id": "ORD-999999",
                "items": [{"sku": "A", "quantity": 1}, {"sku": "B", "quantity": 5}],
                "status": "shipped",
            },
        ],
        [
            {"order_id": "ORD-000123", "items": [], "status": "pending"},
            {"order_id": "ORD-12", "items": [{"sku": "A1", "quantity": 2}], "status": "pending"},
            {
                "order_id": "ORD-000123",
                "items": [{"sku": "A", "quantity": 1}] * 4,
                "status": "pending",
            },
        ],
    ),
    SchemaCase(
        "pydantic_user_with_address_ref",
        {
            "$defs": {
                "Address": {
                    "additionalProperties": False,
                    "properties": {
                        "street": {"title": "Street", "type": "string"},
                        "city": {"title": "City", "type": "string"},
                    },
                    "required": ["street", "city"],
                    "title": "Address",
                    "type": "object",
                }
            },
            "additionalProperties": False,
            "properties": {
                "name": {"title": "Name", "type": "string"},
                "address": {"$ref": "#/$defs/Address"},
                "nickname": {**_NULLABLE_STR, "title": "Nickname"},
            },
            "required": ["name", "address", "nickname"],
            "title": "User",
            "type": "object",
        },
        [
            {"name": "Bo", "address": {"street": "Elm 2", "city": "Oslo"}, "nickname": None},
            {"name": "Bo", "address": {"street": "Elm 2", "city": "Oslo"}, "nickname": "B"},
        ],
        [
            {"name": "Bo", "address": {"street": "Elm 2"}, "nickname": None},
            {"name": "Bo", "address": {"street": "E", "city": "O", "zip": "1"}, "nickname": None},
        ],
    ),
    SchemaCase(
        "optional_fields",
        _obj(
            {"title": _STR, "subtitle": _STR, "pages": _INT, "draft": _BOOL},
            required=["title", "draft"],
        ),
        [
            {"title": "T", "draft": False},
            {"title": "T", "subtitle": "S", "draft": True},
            {"title": "T", "subtitle": "S", "pages": 12, "draft": True},
        ],
        [{"subtitle": "S", "draft": True}, {"title": "T", "draft": "no"}],
    ),
    SchemaCase(
        "shape_tagged_union",
        _obj(
            {
                "shape": {
                    "anyOf": [
                        _obj({"kind": {"const": "circle"}, "radius": _NUM}),
                        _obj({"kind": {"const": "rect"}, "width": _NUM, "height": _NUM}),
                    ]
                }
            }
        ),
        [
            {"shape": {"kind": "circle", "radius": 1.5}},
            {"shape": {"kind": "rect", "width": 2, "height": 3.25}},
        ],
        [{"shape": {"kind": "circle", "width": 2}}, {"shape": {"kind": "square", "radius": 1}}],
    ),
    SchemaCase(
        "tool_call",
        _obj(
            {
                "tool": {"type": "string", "enum": ["get_weather", "get_time"]},
                "arguments": _obj(
                    {
                        "location": _STR,
                        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                    },
                    required=["location"],
                ),
            }
        ),
        [
            {"tool": "get_weather", "arguments": {"location": "Paris", "unit": "celsius"}},
            {"tool": "get_time", "arguments": {"location": "Tokyo"}},
        ],
        [{"tool": "send_email", "arguments": {"location": "x"}}, {"tool": "get_time"}],
    ),
    SchemaCase(
        "sentiment",
        _obj(
            {
                "label": {"type": "string", "enum": ["positive", "negative", "neutral"]},
                "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            }
        ),
        [{"label": "positive", "confidence": 0.93}, {"label": "neutral", "confidence": 0}],
        [{"label": "happy", "confidence": 0.5}, {"label": "positive"}],
    ),
    SchemaCase(
        "tree_recursive_ref",
        {
            "$defs": {
                "Node": _obj(
                    {
                        "value": _INT,
                        "children": {
                            "type": "array",
                            "maxItems": 2,
                            "items": {"$ref": "#/$defs/Node"},
                        },
                    }
                )
            },
            "$ref": "#/$defs/Node",
        },
        [
            {"value": 1, "children": []},
            {"value": 1, "children": [{"value": 2, "children": [{"value": 3, "children": []}]}]},
        ],
        [{"value": 1}, {"value": 1, "children": [{"value": "2", "children": []}]}],
    ),
    SchemaCase(
        "string_list_root",
        {"type": "array", "items": _STR, "minItems": 2, "maxItems": 4},
        [["a", "b"], ["red", "green", "blue", "cyan"]],
        [["a"], ["a", "b", "c", "d", "e"], ["a", 1]],
    ),
    SchemaCase(
        "inventory_map",
        _obj({"warehouse": _STR, "stock": {"type": "object", "additionalProperties": _INT}}),
        [{"warehouse": "W1", "stock": {"apples": 3, "pears": 0}}, {"warehouse": "W", "stock": {}}],
        [{"warehouse": "W1", "stock": {"apples": "3"}}],
    ),
    SchemaCase(
        "versioned_const",
        _obj({"version": {"const": 2}, "enabled": _BOOL, "note": {"type": "null"}}),
        [{"version": 2, "enabled": True, "note": None}],
        [{"version": 3, "enabled": True, "note": None}, {"version": 2, "enabled": 1, "note": None}],
    ),
    SchemaCase(
        "username_lengths",
        _obj({"username": {"type": "string", "minLength": 3, "maxLength": 12}, "admin": _BOOL}),
        [{"username": "bob", "admin": False}, {"username": "alice_smith1", "admin": True}],
        [{"username": "al", "admin": False}, {"username": "a" * 13, "admin": False}],
    ),
    SchemaCase(
        "geo_point_tuple",
        _obj(
            {
                "name": _STR,
                "point": {
                    "type": "array",
                    "prefixItems": [_NUM, _NUM],
                    "items": False,
                    "minItems": 2,
                },
            }
        ),
        [{"name": "Oslo", "point": [59.91, 10.75]}],
        [{"name": "Oslo", "point": [59.91]}, {"name": "Oslo", "point": [1, 2, 3]}],
    ),
    SchemaCase(
        "matrix",
        _obj(
            {
                "rows": {
                    "type": "array",
                    "minItems": 2,
                    "maxItems": 2,
                    "items": {"type": "array", "items": _INT, "minItems": 2, "maxItems": 2},
                }
            }
        ),
        [{"rows": [[1, 0], [0, 1]]}],
        [{"rows": [[1, 0]]}, {"rows": [[1, 0, 0], [0, 1, 0]]}, {"rows": [[1.5, 0], [0, 1]]}],
    ),
    SchemaCase(
        "entity_extraction",
        _obj(
            {
                "entities": {
                    "type": "array",
                    "maxItems": 4,
                    "items": _obj(
                        {
                            "text": _STR,
                            "type": {"type": "string", "enum": ["PERSON", "ORG", "LOC"]},
                            "start": {"type": "integer", "minimum": 0},
                        }
                    ),
                }
            }
        ),
        [
            {"entities": []},
            {
                "entities": [
                    {"text": "Marie Curie", "type": "PERSON", "start": 0},
                    {"text": "Paris", "type": "LOC", "start": 24},
                ]
            },
        ],
        [{"entities": [{"text": "X", "type": "DATE", "start": 0}]}],
    ),
    SchemaCase(
        "recipe",
        _obj(
            {
                "name": _STR,
                "servings": {"type": "integer", "minimum": 1, "maximum": 12},
                "ingredients": {
                    "type": "array",
                    "minItems": 1,
                    "items": _obj(
                        {
                            "item": _STR,
                            "amount": _NUM,
                            "unit": {"anyOf": [{"enum": ["g", "ml", "tsp"]}, {"type": "null"}]},
                        }
                    ),
                },
                "steps": {"type": "array", "items": _STR, "minItems": 1},
            }
        ),
        [
            {
                "name": "Tea",
                "servings": 1,
                "ingredients": [
                    {"item": "water", "amount": 250, "unit": "ml"},
                    {"item": "tea bag", "amount": 1, "unit": None},
                ],
                "steps": ["Boil water.", "Steep 3 minutes."],
            }
        ],
        [
            {"name": "Tea", "servings": 1, "ingredients": [], "steps": ["Boil."]},
            {
                "name": "Tea",
                "servings": 1,
                "ingredients": [{"item": "w", "amount": 1, "unit": "cup"}],
                "steps": ["Boil."],
            },
        ],
    ),
    SchemaCase(
        "pydantic_enum_defs_and_defaults",
        {
            "$defs": {
                "Priority": {
                    "enum": ["low", "medium", "high"],
                    "title": "Priority",
                    "type": "string",
                }
            },
            "additionalProperties": False,
            "properties": {
                "title": {"title": "Title", "type": "string"},
                "priority": {"$ref": "#/$defs/Priority", "default": "medium"},
                "tags": {
                    "anyOf": [{"items": {"type": "string"}, "type": "array"}, {"type": "null"}],
                    "default": None,
                    "title": "Tags",
                },
                "done": {"default": False, "title": "Done", "type": "boolean"},
            },
            "required": ["title"],
            "title": "Task",
            "type": "object",
        },
        [
            {"title": "Write tests"},
            {"title": "Ship", "priority": "high", "tags": ["release"], "done": False},
            {"title": "Ship", "tags": None},
        ],
        [{"title": "Ship", "priority": "urgent"}, {"title": "Ship", "owner": "me"}],
    ),
    SchemaCase(
        "allof_ref_with_description",
        {
            "$defs": {"Unit": {"enum": ["C", "F"], "type": "string"}},
            "type": "object",
            "properties": {
                "city": _STR,
                "temperature": _NUM,
                "unit": {"allOf": [{"$ref": "#/$defs/Unit"}], "description": "Scale."},
            },
            "required": ["city", "temperature", "unit"],
        },
        [{"city": "Rome", "temperature": 21.5, "unit": "C"}],
        [{"city": "Rome", "temperature": 21.5, "unit": "K"}],
    ),
    SchemaCase(
        "id_oneof_string_or_int",
        _obj({"id": {"oneOf": [{"type": "integer"}, {"type": "string", "pattern": "^u[0-9]+$"}]}}),
        [{"id": 42}, {"id": "u42"}],
        [{"id": "x42"}, {"id": True}],
    ),
    SchemaCase(
        "server_config_nested",
        _obj(
            {
                "server": _obj(
                    {
                        "host": _STR,
                        "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                        "tls": _obj({"enabled": _BOOL, "cert_path": _STR}, required=["enabled"]),
                    }
                ),
                "log_level": {"type": "string", "enum": ["debug", "info", "warning", "error"]},
            },
            additionalProperties=False,
        ),
        [
            {
                "server": {"host": "0.0.0.0", "port": 8080, "tls": {"enabled": False}},
                "log_level": "info",
            },
            {
                "server": {
                    "host": "example.com",
                    "port": 443,
                    "tls": {"enabled": True, "cert_path": "/etc/cert.pem"},
                },
                "log_level": "warning",
            },
        ],
        [
            {"server": {"host": "h", "port": 80}, "log_level": "info"},
            {"server": {"host": "h", "port": 80, "tls": {"enabled": True}}, "log_level": "trace"},
        ],
    ),
    SchemaCase(
        "date_and_uuid_formats",
        _obj(
            {
                "event_id": {"type": "string", "format": "uuid"},
                "date": {"type": "string", "format": "date"},
                "attendees": {"type": "array", "items": _STR, "maxItems": 3},
            }
        ),
        [
            {
                "event_id": "123e4567-e89b-12d3-a456-426614174000",
                "date": "2024-05-17",
                "attendees": ["ann", "bo"],
            }
        ],
        [{"event_id": "123", "date": "2024-05-17", "attendees": []}],
    ),
]


def example_messages(case: SchemaCase) -> list[dict[str, str]]:
    """A chat asking for another instance of the case, shown its first valid one: the few-shot
    prompt a client writes. The grammar fixes the shape either way; the example keeps a small
    model's values short (asked with no example, SmolLM2-135M runs a string or an array on to
    max_tokens for a third of the schemas, greedy)."""
    example = json.dumps(case.valid[0])
    what = case.name.replace("_", " ")
    return [
        {"role": "system", "content": "You reply with one JSON value and nothing else."},
        {
            "role": "user",
            "content": f"Here is an example of a {what}: {example}\nWrite another one with "
            "different values.",
        },
    ]
