"""JSON schemas made ready for xgrammar wherever a spec holds one: a response_format's schema,
and every `json_schema` element of a structural tag (each tool's arguments, a response_format
beside tools or after reasoning). Both must be enforced alike: a schema that is only prepared on
one path is enforced in part, or not at all, on the other."""

from __future__ import annotations

import json
from typing import Any

from yaied.structured.schema_merge import merge_all_of


def prepare_schema(schema: Any) -> Any:
    """`schema` as xgrammar must see it to enforce what the client asked for; a new value."""
    if not isinstance(schema, dict):
        return schema
    return merge_all_of(schema)


def prepare_schema_source(source: str) -> str:
    """`prepare_schema` over a schema's JSON text; the text as it is when nothing changes."""
    schema = json.loads(source)
    prepared = prepare_schema(schema)
    if prepared == schema:
        return source
    return _dumps(prepared)


def prepare_structural_tag_source(source: str) -> str:
    """A structural tag's JSON text with the schema of each `json_schema` element prepared."""
    tag = json.loads(source)
    prepared = _prepare_tag(tag)
    if prepared == tag:
        return source
    return _dumps(prepared)


def _prepare_tag(value: Any) -> Any:
    if isinstance(value, list):
        return [_prepare_tag(item) for item in value]
    if not isinstance(value, dict):
        return value
    if value.get("type") == "json_schema" and "json_schema" in value:
        return {**value, "json_schema": prepare_schema(value["json_schema"])}
    return {key: _prepare_tag(item) for key, item in value.items()}


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
