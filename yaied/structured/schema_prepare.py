"""JSON schemas made ready for xgrammar wherever a spec holds one: a response_format's schema,
and every `json_schema` element of a structural tag (each tool's arguments, a response_format
beside tools or after reasoning). Both must be enforced alike: a schema that is only prepared on
one path is enforced in part, or not at all, on the other.

- `allOf` of object schemas: merged into one (`schema_merge`).
- A name in `required` that `properties` does not list: xgrammar writes only the listed
  properties, so it wrote objects without that name, which the schema refuses. It is listed,
  with the schema `additionalProperties` (or a matching `patternProperties`) gives it, any
  value when none; where `additionalProperties` is false the schema has no instance: refused.
- A lookahead in a `pattern`: xgrammar drops it there (and refuses it in a `regex`
  constraint), so the pattern would hold only in part; refused, as in a regex.
- A `$ref` outside the schema (a URL, another file, an anchor): nothing is fetched, and xgrammar
  would let any value through in its place; refused.

The last two are refused in a response_format's own schema, which the client wrote to be
enforced. In a structural tag they pass with a warning in the log (`lenient`): tools often come
from elsewhere (an MCP server's schemas, which the agent cannot edit) and may never be called,
so a request is not refused for a pattern or a reference in one of them.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from typing import Any

from yaied.structured.schema_merge import merge_all_of

log = logging.getLogger(__name__)


def prepare_schema(schema: Any, *, lenient: bool = False) -> Any:
    """`schema` as xgrammar must see it to enforce what the client asked for; a new value.
    ``lenient``: what xgrammar cannot enforce in full passes with a warning (see above)."""
    if not isinstance(schema, dict):
        return schema
    return _prepare_node(merge_all_of(schema), lenient)


def prepare_schema_source(source: str) -> str:
    """`prepare_schema` over a schema's JSON text; the text as it is when nothing changes."""
    return _prepared_text(source, prepare_schema)


def prepare_structural_tag_source(source: str) -> str:
    """A structural tag's JSON text with the schema of each `json_schema` element prepared."""
    return _prepared_text(source, _prepare_tag)


def _prepared_text(source: str, prepare: Callable[[Any], Any]) -> str:
    value = json.loads(source)
    prepared = prepare(value)
    return source if prepared == value else _dumps(prepared)


def _prepare_tag(value: Any) -> Any:
    if isinstance(value, list):
        return [_prepare_tag(item) for item in value]
    if not isinstance(value, dict):
        return value
    if value.get("type") == "json_schema" and "json_schema" in value:
        return {**value, "json_schema": prepare_schema(value["json_schema"], lenient=True)}
    return {key: _prepare_tag(item) for key, item in value.items()}


# Keywords whose value is one subschema, or a list of them, or a map of names to them.
_ONE = ("additionalProperties", "items", "not", "if", "then", "else", "contains", "propertyNames")
_MANY = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")


def _prepare_node(schema: Any, lenient: bool) -> Any:
    if isinstance(schema, list):  # `items` as a list (draft 4's tuples)
        return [_prepare_node(item, lenient) for item in schema]
    if not isinstance(schema, dict):
        return schema
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref != "#" and not ref.startswith("#/"):
        _refuse(
            f"$ref {ref!r}: only references inside the schema ('#' or '#/...') are supported",
            lenient,
        )
    pattern = schema.get("pattern")
    if isinstance(pattern, str) and _has_lookahead(pattern):
        _refuse(
            f"pattern {pattern!r}: lookahead ((?=...), (?!...)) is not supported, and would "
            "not be enforced",
            lenient,
        )
    out = dict(schema)
    for key in _ONE:
        if key in out:
            out[key] = _prepare_node(out[key], lenient)
    for key in _MANY:
        if isinstance(out.get(key), list):
            out[key] = [_prepare_node(item, lenient) for item in out[key]]
    for key in _MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _prepare_node(sub, lenient) for name, sub in out[key].items()}
    required = out.get("required")
    if isinstance(required, list) and _may_be_object(out):
        properties = out.get("properties")
        properties = dict(properties) if isinstance(properties, dict) else {}
        missing = [name for name in required if isinstance(name, str) and name not in properties]
        for name in missing:
            properties[name] = _unlisted_property(out, name)
        if missing:
            out["properties"] = properties
    return out


def _refuse(reason: str, lenient: bool) -> None:
    if not lenient:
        raise ValueError(reason)
    # once per grammar compiled: the compiler's cache keeps the grammar, not this warning
    log.warning("a tool's schema is enforced in part: %s", reason)


def _has_lookahead(pattern: str) -> bool:
    """Whether `pattern` holds a `(?=` or `(?!` outside a character class and not escaped."""
    escaped = in_class = False
    for i, char in enumerate(pattern):
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
        elif pattern.startswith(("(?=", "(?!"), i):
            return True
    return False


def _may_be_object(schema: dict[str, Any]) -> bool:
    kind = schema.get("type", "object")
    return kind == "object" or (isinstance(kind, list) and "object" in kind)


def _unlisted_property(schema: dict[str, Any], name: str) -> Any:
    """The schema a property `properties` does not list gets: a matching patternProperties
    entry's, else additionalProperties' (any value when absent or true)."""
    for pattern, sub in (schema.get("patternProperties") or {}).items():
        try:
            if re.search(pattern, name):
                return sub
        except re.error:
            continue
    extra = schema.get("additionalProperties", True)
    if extra is False:
        raise ValueError(
            f"required property {name!r} is not in properties and additionalProperties is "
            "false, so no object can hold it"
        )
    return {} if extra is True else extra


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
