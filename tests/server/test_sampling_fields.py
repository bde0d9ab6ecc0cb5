"""The table of sampling fields (core/sampling_fields.py) against SamplingParams and everything
derived from it: the request parser, the OpenAPI schema, the 400s' parameter names and a remote
engine's request body. A new SamplingParams field fails here until it has a row and an example,
and then it is checked end to end like every other."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import orjson
import pytest

from yaied.core.request import SamplingParams
from yaied.core.sampling_fields import (
    ENDPOINTS,
    FIELDS,
    GENERATION_CONFIG_KEYS,
    NOT_IN_TABLE,
    Endpoint,
)
from yaied.router.config import EngineEntry, RouterConfig
from yaied.router.remote import RemoteHandle, request_body
from yaied.server.chat_protocol import CHAT_FIELDS, parse_chat
from yaied.server.errors import APIError, from_value_error, request_aliases
from yaied.server.openapi import openapi_schema
from yaied.server.protocol import COMPLETION_FIELDS, ParsedRequest, parse_completion

# A valid value other than the default for every field.
EXAMPLES: dict[str, Any] = {
    "max_tokens": 7,
    "temperature": 0.5,
    "top_p": 0.9,
    "top_k": 5,
    "min_p": 0.1,
    "ignore_eos": True,
    "stop": ("x", "yz"),
    "stop_token_ids": (3, 4),
    "include_stop_str_in_output": True,
    "skip_special_tokens": False,
    "seed": 11,
    "presence_penalty": 0.5,
    "frequency_penalty": -0.5,
    "repetition_penalty": 1.2,
    "logit_bias": ((3, 1.5), (9, -100.0)),
    "min_tokens": 2,
    "logprobs": 3,
    "prompt_logprobs": 2,
}
PATHS = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}
PARSERS = {"completion": parse_completion, "chat": parse_chat}
BASE = {"completion": {"prompt": "x"}, "chat": {"messages": [{"role": "user", "content": "x"}]}}


def params_of(parsed: ParsedRequest) -> SamplingParams:
    """SamplingParams as the server builds them from a parsed request (server/serving.py),
    chat's open max_tokens aside."""
    kwargs = dict(parsed.sampling, max_tokens=parsed.max_tokens or 16)
    if parsed.logprobs is not None:
        kwargs["logprobs"] = parsed.logprobs
    return SamplingParams(**kwargs)


def conforms(value: Any, schema: dict[str, Any]) -> bool:
    """The part of OpenAPI 3.0 validation the table's schemas use."""
    if "oneOf" in schema:
        return sum(conforms(value, branch) for branch in schema["oneOf"]) == 1
    kinds = {"integer": int, "number": int | float, "boolean": bool, "string": str}
    kinds |= {"array": list, "object": dict}
    kind = schema["type"]
    if isinstance(value, bool) != (kind == "boolean") or not isinstance(value, kinds[kind]):
        return False
    low = schema.get("minimum")
    if low is not None and (value < low or (schema.get("exclusiveMinimum") and value == low)):
        return False
    if "maximum" in schema and value > schema["maximum"]:
        return False
    if kind == "array":
        return all(conforms(item, schema["items"]) for item in value)
    if kind == "object":
        return all(conforms(item, schema["additionalProperties"]) for item in value.values())
    return True


def request_schema(endpoint: Endpoint) -> dict[str, Any]:
    post = openapi_schema("test")["paths"][PATHS[endpoint]]["post"]
    return post["requestBody"]["content"]["application/json"]["schema"]


def test_the_table_has_every_sampling_params_field_in_order():
    listed = [f.name for f in fields(SamplingParams) if f.name not in NOT_IN_TABLE]
    assert [f.name for f in FIELDS] == listed
    assert set(NOT_IN_TABLE) <= {f.name for f in fields(SamplingParams)}
    assert set(EXAMPLES) == {f.name for f in FIELDS}, "add an example for the new field"
    defaults = SamplingParams()
    for spec in FIELDS:
        assert EXAMPLES[spec.name] != getattr(defaults, spec.name), spec.name
        example = SamplingParams(**{spec.name: EXAMPLES[spec.name]})
        assert getattr(example, spec.name) == EXAMPLES[spec.name], spec.name


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_every_request_name_is_in_the_openapi_schema_and_known_to_the_parser(endpoint):
    schema = request_schema(endpoint)
    known = COMPLETION_FIELDS if endpoint == "completion" else CHAT_FIELDS
    for spec in FIELDS:
        property_schema = spec.schema_for(endpoint)
        assert spec.json_types, spec.name
        assert conforms(spec.to_json(EXAMPLES[spec.name]), property_schema), spec.name
        if "default" in property_schema:
            assert conforms(property_schema["default"], property_schema), spec.name
        for name in spec.names(endpoint):
            assert schema["properties"][name] == property_schema, name
            assert name in known, name
    # The drift that made this table: these were missing from the schema.
    for name in ("include_stop_str_in_output", "skip_special_tokens"):
        assert name in schema["properties"]


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_every_request_name_parses_into_its_sampling_params_field(endpoint):
    for spec in FIELDS:
        for name in spec.names(endpoint):
            value = spec.to_json(EXAMPLES[spec.name])
            body = {**BASE[endpoint], name: value}
            if endpoint == "chat" and spec.name == "logprobs":
                body["logprobs"] = True  # top_logprobs counts only with it
            params = params_of(PARSERS[endpoint](body))
            assert getattr(params, spec.name) == EXAMPLES[spec.name], name
            bad = {**body, name: object()}  # no JSON type at all: a 400 naming the request field
            with pytest.raises(APIError) as info:
                PARSERS[endpoint](bad)
            assert (info.value.status, info.value.param) == (400, name)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_all_fields_at_once_and_absent_fields_mean_the_advertised_defaults(endpoint):
    body = dict(BASE[endpoint])
    expected = {}
    for spec in FIELDS:
        if spec.names(endpoint):
            body[spec.names(endpoint)[0]] = spec.to_json(EXAMPLES[spec.name])
            expected[spec.name] = EXAMPLES[spec.name]
    if endpoint == "chat":
        body["logprobs"] = True
    assert params_of(PARSERS[endpoint](body)) == SamplingParams(**expected)
    bare = PARSERS[endpoint](dict(BASE[endpoint]))
    assert bare.sampling == {}
    absent = params_of(bare)
    properties = request_schema(endpoint)["properties"]
    for spec in FIELDS:
        for name in spec.names(endpoint):
            if "default" in properties[name]:
                assert spec.to_json(getattr(absent, spec.name)) == properties[name]["default"]
    assert bare.max_tokens == properties["max_tokens"].get("default")  # 16; chat: None


def test_request_body_round_trips_through_a_remote_daemons_parser():
    sent = {spec.name: EXAMPLES[spec.name] for spec in FIELDS if spec.remote}
    params = SamplingParams(**sent)
    body = orjson.loads(orjson.dumps(request_body([1, 2], params, priority=3)))
    call = {"prompt", "stream", "stream_options", "return_token_ids", "priority"}
    assert set(body) - call == {spec.names("completion")[0] for spec in FIELDS if spec.remote}
    assert params_of(parse_completion(body)) == params
    # Defaults travel too, so the remote daemon's model defaults cannot replace the router's.
    assert params_of(parse_completion(request_body([1], SamplingParams(), 0))) == SamplingParams()


def test_a_remote_engine_refuses_what_it_is_not_sent():
    remote = RemoteHandle("r", EngineEntry(kind="remote", url="http://x"), RouterConfig())
    sent = {spec.name: EXAMPLES[spec.name] for spec in FIELDS if spec.remote}
    assert remote.supports(SamplingParams(**sent))
    for spec in FIELDS:
        if not spec.remote:
            assert not remote.supports(SamplingParams(**{spec.name: EXAMPLES[spec.name]}))


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_value_errors_name_the_request_field(endpoint):
    aliases = request_aliases(endpoint)
    for spec in FIELDS:
        error = from_value_error(ValueError(f"{spec.name} must be something else"), aliases)
        names = spec.names(endpoint)
        assert error.param == (names[0] if names else spec.name), spec.name


def test_generation_config_defaults_are_the_table_s():
    from yaied.worker import model_files

    assert model_files._SAMPLING_DEFAULT_KEYS == GENERATION_CONFIG_KEYS


def test_an_output_constraint_travels_to_a_remote_daemon_as_structured_outputs():
    from yaied.core.grammar_spec import make_spec, parse_structured_output

    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    specs = [
        make_spec("json_schema", schema, "guided_json"),
        make_spec("json_object", None, "response_format"),
        make_spec("regex", r"\d+", "guided_regex"),
        make_spec("choice", ["yes", "no"], "guided_choice"),
        make_spec("grammar", 'root ::= "a"', "guided_grammar"),
    ]
    for spec in specs:
        body = orjson.loads(orjson.dumps(request_body([1], SamplingParams(structured=spec), 0)))
        assert parse_structured_output(body) == spec
        assert params_of(parse_completion(body)) == SamplingParams()  # the rest: defaults
        assert parse_completion(body).structured == spec
    assert "structured_outputs" not in request_body([1], SamplingParams(), 0)
