"""JSON schemas made ready for xgrammar: an `allOf` of object schemas merged into one.

xgrammar (0.2.9) compiles an `allOf` of two or more members to "any JSON value" (with a logged
warning), and one member beside the schema's own `properties` to that member alone, so a schema
that pydantic writes for a model that extends another would not be enforced, or only in part.
Merging such an `allOf` into one object schema first keeps what the client asked for.
"""

from __future__ import annotations

import json
from typing import Any

# The keywords an object schema may hold for its `allOf` to be merged into one object schema.
_MERGEABLE_KEYS = frozenset(
    {"type", "properties", "required", "additionalProperties", "title", "description"}
)
# What the schema holding the `allOf` keeps as it is beside the merge (the root's definitions).
_KEPT_KEYS = frozenset({"$defs", "definitions", "$schema", "$id"})


def merge_object_all_of(source: str) -> str:
    """`source` with every `allOf` of object schemas (each inline or a `$ref` into
    `$defs`/`definitions`) merged, with the properties beside it, into one object schema:
    properties and `required` joined, `additionalProperties: false` kept. xgrammar turns an
    `allOf` of two or more into "any JSON value", and of one beside `properties` into that one
    alone, so without this the schema would not be enforced, or only in part. An `allOf` whose
    members are not all plain object schemas is left as it is."""
    if '"allOf"' not in source:
        return source
    schema = json.loads(source)
    if not isinstance(schema, dict):
        return source
    return json.dumps(merge_all_of(schema), separators=(",", ":"), ensure_ascii=False)


def merge_all_of(schema: dict[str, Any]) -> dict[str, Any]:
    """`merge_object_all_of` on a parsed schema: a new schema, `schema` left as it is."""
    return _merge_walk(schema, schema)


def _merge_walk(value: Any, root: dict[str, Any]) -> Any:
    if isinstance(value, list):
        return [_merge_walk(item, root) for item in value]
    if not isinstance(value, dict):
        return value
    members = value.get("allOf")
    # One member beside properties of the schema's own: xgrammar keeps the member alone.
    if isinstance(members, list) and (len(members) > 1 or (members and "properties" in value)):
        merged = _merge_objects(value, members, root)
        if merged is not None:
            value = merged
    return {key: _merge_walk(item, root) for key, item in value.items()}


def _merge_objects(
    schema: dict[str, Any], members: list[Any], root: dict[str, Any]
) -> dict[str, Any] | None:
    kept = {key: item for key, item in schema.items() if key in _KEPT_KEYS}
    own = {key: item for key, item in schema.items() if key != "allOf" and key not in _KEPT_KEYS}
    parts = [*(_resolve_ref(member, root) for member in members), own]
    for part in parts:
        if not isinstance(part, dict) or not set(part) <= _MERGEABLE_KEYS:
            return None
        if part.get("type", "object") != "object":
            return None
    properties: dict[str, Any] = {}
    required: list[str] = []
    merged: dict[str, Any] = {**kept, "type": "object"}
    for part in parts:
        for name, sub in (part.get("properties") or {}).items():
            if name in properties and properties[name] != sub:
                sub = {"allOf": [properties[name], sub]}
            properties[name] = sub
        required += [name for name in part.get("required") or [] if name not in required]
        for key in ("title", "description"):
            if key in part:
                merged.setdefault(key, part[key])
        if "additionalProperties" in part and merged.get("additionalProperties") is not False:
            merged["additionalProperties"] = part["additionalProperties"]
    merged["properties"] = properties
    if required:
        merged["required"] = required
    return merged


def _resolve_ref(member: Any, root: dict[str, Any]) -> Any:
    """A `{"$ref": "#/$defs/Name"}` member (with at most a title or description beside it)
    replaced by what it names; anything else as it is."""
    if not isinstance(member, dict) or not isinstance(member.get("$ref"), str):
        return member
    if not set(member) <= {"$ref", "title", "description"}:
        return member
    for prefix in ("#/$defs/", "#/definitions/"):
        if member["$ref"].startswith(prefix):
            defs = root.get(prefix[2:-1])
            name = member["$ref"][len(prefix) :]
            if isinstance(defs, dict) and isinstance(defs.get(name), dict):
                return defs[name]
    return member
