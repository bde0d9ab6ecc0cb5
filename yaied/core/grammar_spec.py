"""What a request asks its output to match, parsed from the request body into one `GrammarSpec`.

It lives in core because every layer carries it: `SamplingParams.structured` holds the spec from
the server's parser to the engine's matcher. The parser is pure (no tokenizer, no xgrammar, no
torch), so the server can reject a malformed constraint with a 400 before anything is compiled
or queued; compiling is `yaied.structured`'s. Every error is a `StructuredOutputError`, a
`ValueError` whose `param` names the offending field as the client spelled it, for OpenAI's
error shape.

Accepted fields (at most one constraint per request; a second one is an error, never ignored):

- ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}``;
- ``structured_outputs``: exactly one of ``json``, ``regex``, ``choice``, ``grammar``,
  ``json_object``, ``structural_tag`` (xgrammar's structural tag, an object or its JSON text: what
  tool calling and reasoning build, and what a remote engine is sent for them);
- the older aliases ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

SpecKind = Literal["json_schema", "json_object", "regex", "choice", "grammar", "structural_tag"]
SPEC_KINDS: frozenset[str] = frozenset(get_args(SpecKind))

# The largest canonical source accepted, in UTF-8 bytes. Compile time and grammar memory grow
# with the spec; 64 KiB is far above any schema an SDK emits (pydantic models of a few dozen
# fields are 2-8 KiB) and low enough that one request cannot pin much of the compile cache.
MAX_SPEC_BYTES = 64 * 1024
# JSON nesting depth of a schema. Canonicalisation recurses, and xgrammar's converter does too.
MAX_SCHEMA_DEPTH = 64

# Keys of a JSON schema whose value is data, not a schema: key order inside is the user's.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples", "example"})
# Maps from a user's property name to a schema: their key order is the order xgrammar makes the
# model write the properties in (it follows the schema's declared order), so sorting them would
# change the output, and two schemas differing only there must not share a cache entry.
_ORDERED_MAPS = frozenset({"properties"})

_STRUCTURED_KEYS: dict[str, SpecKind] = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "json_object",
    "structural_tag": "structural_tag",
}
_GUIDED_ALIASES: dict[str, SpecKind] = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


class StructuredOutputError(ValueError):
    """An invalid constraint: the server answers 400 with `param` and this message."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """One output constraint in canonical form.

    `source` is canonical for its kind (build specs with `make_spec` or `parse_structured_output`
    to get that): a JSON schema as compact JSON with sorted keywords, a choice list as a compact
    JSON list, a regex or EBNF grammar verbatim, and an empty string for ``json_object``. `param`
    is the request field the spec came from, for error messages; it is not part of the identity.
    """

    kind: SpecKind
    source: str
    param: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.kind not in SPEC_KINDS:
            raise ValueError(f"unknown grammar kind {self.kind!r}")

    @property
    def key(self) -> str:
        """The compile-cache key: equal for specs that compile to the same grammar."""
        return f"{self.kind}\x00{self.source}"


def canonical_json_schema(schema: Any, param: str) -> str:
    """Compact JSON with every schema object's keywords sorted, so that clients that emit the
    same schema with keywords in a different order share one cache entry. `properties` maps and
    data values (`enum`, `const`, ...) keep their order (see `_ORDERED_MAPS`)."""
    canonical = _canonicalize(schema, param, depth=0)
    return json.dumps(canonical, separators=(",", ":"), ensure_ascii=False)


def _canonicalize(value: Any, param: str, depth: int) -> Any:
    if depth > MAX_SCHEMA_DEPTH:
        raise StructuredOutputError(param, f"the schema is nested deeper than {MAX_SCHEMA_DEPTH}")
    if isinstance(value, list):
        return [_canonicalize(item, param, depth + 1) for item in value]
    if not isinstance(value, dict):
        if isinstance(value, float) and value != value:  # NaN is not JSON; json.dumps would emit it
            raise StructuredOutputError(param, "the schema contains NaN")
        return value
    out: dict[str, Any] = {}
    for key, item in sorted(value.items()):
        if key in _DATA_KEYWORDS:
            _check_depth(item, param, depth + 1)
            out[key] = item
        elif key in _ORDERED_MAPS and isinstance(item, dict):
            out[key] = {name: _canonicalize(sub, param, depth + 2) for name, sub in item.items()}
        else:
            out[key] = _canonicalize(item, param, depth + 1)
    return out


def _check_depth(value: Any, param: str, depth: int) -> None:
    if depth > MAX_SCHEMA_DEPTH:
        raise StructuredOutputError(param, f"the schema is nested deeper than {MAX_SCHEMA_DEPTH}")
    if isinstance(value, dict):
        for item in value.values():
            _check_depth(item, param, depth + 1)
    elif isinstance(value, list):
        for item in value:
            _check_depth(item, param, depth + 1)


def make_spec(kind: SpecKind, value: Any, param: str) -> GrammarSpec:
    """Validate one constraint's value and canonicalise it into a spec.

    `value` is what the request carried: a schema (object, or a string holding one) for
    ``json_schema``, an object (or its JSON text) for ``structural_tag``, a string for ``regex``
    and ``grammar``, a list of strings for ``choice``; ignored for ``json_object``.
    """
    if kind in ("json_schema", "structural_tag"):
        what = "schema" if kind == "json_schema" else "structural tag"
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise StructuredOutputError(param, f"the {what} is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise StructuredOutputError(param, f"the {what} must be a JSON object")
        # A structural tag nests JSON schemas; the same canonical form serves it (the order of
        # its `elements` lists is kept, as every list's is).
        source = canonical_json_schema(value, param)
    elif kind == "json_object":
        source = ""
    elif kind in ("regex", "grammar"):
        if not isinstance(value, str) or not value.strip():
            what = "regular expression" if kind == "regex" else "grammar"
            raise StructuredOutputError(param, f"the {what} must be a non-empty string")
        source = value
    elif kind == "choice":
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(choice, str) for choice in value)
        ):
            raise StructuredOutputError(param, "choice must be a non-empty list of strings")
        source = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    else:
        raise StructuredOutputError(param, f"unknown constraint kind {kind!r}")
    size = len(source.encode("utf-8", "surrogatepass"))
    if size > MAX_SPEC_BYTES:
        raise StructuredOutputError(
            param, f"the constraint is {size} bytes, over the limit of {MAX_SPEC_BYTES} bytes"
        )
    return GrammarSpec(kind, source, param)


def parse_structured_output(body: Mapping[str, Any]) -> GrammarSpec | None:
    """The constraint a request body asks for, or None for unconstrained output.

    Looks at ``response_format``, ``structured_outputs`` and the ``guided_*`` aliases; a field
    that is absent or null asks for nothing. Raises `StructuredOutputError` for a malformed
    field, an unknown type, or more than one constraint.
    """
    found: list[GrammarSpec] = []
    response_format = body.get("response_format")
    if response_format is not None:
        spec = _parse_response_format(response_format)
        if spec is not None:
            found.append(spec)
    structured = body.get("structured_outputs")
    if structured is not None:
        found.extend(_parse_structured_outputs(structured))
    for name, kind in _GUIDED_ALIASES.items():
        value = body.get(name)
        if value is not None:
            found.append(make_spec(kind, value, name))
    if len(found) > 1:
        names = ", ".join(spec.param for spec in found)
        raise StructuredOutputError(
            found[1].param, f"only one output constraint is allowed per request, got {names}"
        )
    return found[0] if found else None


def request_field(spec: GrammarSpec) -> dict[str, Any]:
    """The ``structured_outputs`` value that asks another daemon for exactly this spec (a remote
    engine's request body); `parse_structured_output` reads it back to an equal spec."""
    if spec.kind == "json_schema":
        return {"json": json.loads(spec.source)}
    if spec.kind == "structural_tag":
        return {"structural_tag": json.loads(spec.source)}
    if spec.kind == "json_object":
        return {"json_object": True}
    if spec.kind == "choice":
        return {"choice": json.loads(spec.source)}
    return {spec.kind: spec.source}  # regex, grammar: verbatim


def _parse_response_format(value: Any) -> GrammarSpec | None:
    param = "response_format"
    if not isinstance(value, dict):
        raise StructuredOutputError(param, "response_format must be an object")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return make_spec("json_object", None, param)
    if kind != "json_schema":
        raise StructuredOutputError(
            f"{param}.type",
            f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
        )
    param = "response_format.json_schema"
    inner = value.get("json_schema")
    if not isinstance(inner, dict):
        raise StructuredOutputError(param, "response_format.json_schema must be an object")
    for key, types, what in (
        ("name", (str,), "a string"),
        ("description", (str,), "a string"),
        ("strict", (bool,), "a boolean"),
    ):
        if inner.get(key) is not None and not isinstance(inner[key], types):
            raise StructuredOutputError(f"{param}.{key}", f"{param}.{key} must be {what}")
    # `strict` needs no handling: the schema is always enforced in full (outputs never carry
    # properties the schema does not name), which is what strict asks for.
    schema = inner.get("schema")
    if schema is None:
        raise StructuredOutputError(f"{param}.schema", f"{param}.schema is required")
    return make_spec("json_schema", schema, f"{param}.schema")


def _parse_structured_outputs(value: Any) -> list[GrammarSpec]:
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise StructuredOutputError(param, "structured_outputs must be an object")
    unknown = sorted(set(value) - set(_STRUCTURED_KEYS))
    if unknown:
        allowed = ", ".join(_STRUCTURED_KEYS)
        raise StructuredOutputError(
            f"{param}.{unknown[0]}",
            f"unsupported structured_outputs field(s) {', '.join(unknown)}; expected one of "
            f"{allowed}",
        )
    specs: list[GrammarSpec] = []
    for key, kind in _STRUCTURED_KEYS.items():
        item = value.get(key)
        if item is None:
            continue
        if kind == "json_object":
            if not isinstance(item, bool):
                raise StructuredOutputError(f"{param}.{key}", f"{param}.{key} must be a boolean")
            if not item:
                continue  # json_object: false asks for nothing
        specs.append(make_spec(kind, item, f"{param}.{key}"))
    if not specs:
        raise StructuredOutputError(
            param, f"structured_outputs needs exactly one of {', '.join(_STRUCTURED_KEYS)}"
        )
    return specs
