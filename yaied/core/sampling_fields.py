"""The sampling fields as they travel: one row per SamplingParams attribute.

SamplingParams (core/request.py) declares each field's Python type, default and range checks. A
row here says how the field appears in a request: its name on each OpenAI endpoint, its OpenAPI
schema, whether a remote engine is sent it. Everything that lists sampling fields derives from
these rows: the request parser (server/protocol.py; its JSON type check is read from the schema's
type, so the two cannot disagree), the parameter names of its 400s (server/errors.py), the OpenAPI
schema (server/openapi.py) and a remote engine's request body (router/remote.py). Adding a field
is a line in SamplingParams and a line here; tests/server/test_sampling_fields.py fails until
both exist and every consumer agrees with them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

from yaied.core.request import (
    MAX_LOGPROBS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)

Endpoint = Literal["completion", "chat", "responses", "messages"]
# The OpenAI endpoints every sampling field appears on (each row names itself there unless it says
# otherwise). The agents' APIs (OpenAI Responses, Anthropic Messages) take only the few fields
# their own specs define: a row lists its name there explicitly, else the field is unknown (400).
ENDPOINTS: tuple[Endpoint, ...] = ("completion", "chat")
AGENT_ENDPOINTS: tuple[Endpoint, ...] = ("responses", "messages")

# The OpenAPI type of a value -> the Python types json.loads gives for it (an integer is a number).
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "string": (str,),
    "array": (list,),
    "object": (dict,),
}
_DEFAULTS = {f.name: f.default for f in fields(SamplingParams)}


@dataclass(frozen=True, slots=True)
class SamplingField:
    name: str  # the SamplingParams attribute; its ValueErrors start with this name
    schema: Mapping[str, Any]  # OpenAPI 3.0 fragment of the value: JSON type and bounds
    doc: str  # the schema's description
    # Request names per endpoint, the first present one wins (chat's max_completion_tokens over
    # its older max_tokens); None: the attribute's own name; (): not a request field there.
    completion: tuple[str, ...] | None = None
    chat: tuple[str, ...] | None = None
    # Merged over ``schema`` on chat (and the agents' APIs, which are chat underneath), where the
    # endpoints differ; a None value removes the key.
    chat_schema: Mapping[str, Any] | None = None
    # The agents' APIs: () (the default) means the field is not part of that API.
    responses: tuple[str, ...] = ()
    messages: tuple[str, ...] = ()
    remote: bool = True  # sent in a remote engine's body (RemoteHandle.supports refuses the rest)
    model_default: bool = False  # the model's generation_config.json may set the default

    def names(self, endpoint: Endpoint) -> tuple[str, ...]:
        if endpoint == "responses":
            return self.responses
        if endpoint == "messages":
            return self.messages
        names = self.completion if endpoint == "completion" else self.chat
        return (self.name,) if names is None else names

    @property
    def json_types(self) -> tuple[type, ...]:
        """What the parser accepts, from the schema's type (each branch of a oneOf)."""
        branches = self.schema.get("oneOf", [self.schema])
        return tuple(kind for branch in branches for kind in _JSON_TYPES[branch["type"]])

    def to_json(self, value: Any) -> Any:
        """A SamplingParams value as a request carries it: SamplingParams keeps tuples so it stays
        hashable; an object-typed field (logit_bias) keeps (key, value) pairs, JSON's keys are
        strings."""
        if not isinstance(value, tuple):
            return value
        if self.schema.get("type") == "object":
            return {str(key): item for key, item in value}
        return list(value)

    def default(self, endpoint: Endpoint) -> Any:
        """What an absent field means on this endpoint, as JSON; None where it is not fixed (the
        model's generation_config, chat's max_tokens: what the context has left)."""
        return self.schema_for(endpoint).get("default")

    def schema_for(self, endpoint: Endpoint) -> dict[str, Any]:
        """The OpenAPI property of each of this field's request names on the endpoint."""
        schema = {**self.schema, "description": self.doc}
        default = _DEFAULTS[self.name]
        if self.model_default:
            schema["description"] += (
                f" Default: the model's generation_config.json, else {self.to_json(default)}."
            )
        elif default is not None:
            schema["default"] = self.to_json(default)
        if endpoint != "completion" and self.chat_schema:  # the agents' APIs are chat-shaped
            schema.update(self.chat_schema)
        return {key: value for key, value in schema.items() if value is not None}


def _number(**bounds: float | bool) -> dict[str, Any]:
    # OpenAPI 3.0 (JSON Schema draft 4): exclusiveMinimum is a boolean beside minimum.
    return {"type": "number", **bounds}


def _integer(**bounds: int) -> dict[str, Any]:
    return {"type": "integer", **bounds}


_BOOLEAN = {"type": "boolean"}

# In SamplingParams' order (a test holds it so).
FIELDS: tuple[SamplingField, ...] = (
    SamplingField(
        "max_tokens",
        _integer(minimum=0),
        "The most tokens to generate. Completions: 0 generates none (echo with logprobs scores "
        "the prompt). Chat: by default what the context has left, under the server's cap.",
        chat=("max_completion_tokens", "max_tokens"),
        chat_schema={"minimum": 1, "default": None},
        responses=("max_output_tokens",),
        messages=("max_tokens",),
    ),
    SamplingField(
        "temperature",
        _number(minimum=0),
        "Sampling temperature; 0: greedy.",
        model_default=True,
        responses=("temperature",),
        messages=("temperature",),
    ),
    SamplingField(
        "top_p",
        _number(minimum=0, exclusiveMinimum=True, maximum=1),
        "Sample from the most likely tokens whose probabilities add up to top_p.",
        model_default=True,
        responses=("top_p",),
        messages=("top_p",),
    ),
    SamplingField(
        "top_k",
        _integer(minimum=-1),
        "Sample from the k most likely tokens; 0 or -1: all of them.",
        model_default=True,
        messages=("top_k",),
    ),
    SamplingField(
        "min_p",
        _number(minimum=0, maximum=1),
        "Drop the tokens less likely than min_p times the most likely one.",
        model_default=True,
    ),
    SamplingField("ignore_eos", _BOOLEAN, "Generate past the end-of-sequence token."),
    SamplingField(
        "stop",
        {
            "oneOf": [
                {"type": "string", "maxLength": MAX_STOP_STRING_CHARS},
                {
                    "type": "array",
                    "items": {"type": "string", "maxLength": MAX_STOP_STRING_CHARS},
                    "maxItems": MAX_STOP_STRINGS,
                },
            ]
        },
        "Strings that end the generation when it produces one.",
        messages=("stop_sequences",),
    ),
    SamplingField(
        "stop_token_ids",
        {"type": "array", "items": _integer(minimum=0), "maxItems": MAX_STOP_TOKEN_IDS},
        "Token ids that end the generation, beside the model's end-of-sequence ids.",
    ),
    SamplingField(
        "include_stop_str_in_output", _BOOLEAN, "Keep the stop string that matched in the text."
    ),
    SamplingField("skip_special_tokens", _BOOLEAN, "Leave special tokens out of the text."),
    SamplingField(
        "seed",
        _integer(),
        "Same seed, same tokens, whatever else shares the batch; choice k of n uses seed + k.",
    ),
    SamplingField(
        "presence_penalty",
        _number(minimum=-2, maximum=2),
        "Subtracted from the logit of every token the output already holds.",
    ),
    SamplingField(
        "frequency_penalty",
        _number(minimum=-2, maximum=2),
        "Subtracted from a token's logit once for each time the output holds it.",
    ),
    SamplingField(
        "repetition_penalty",
        _number(minimum=0, exclusiveMinimum=True),
        "Over prompt and output tokens: positive logits divided by it, negative ones multiplied.",
        model_default=True,
    ),
    SamplingField(
        "logit_bias",
        {"type": "object", "additionalProperties": {"type": "number"}},
        "Token id -> a bias added to its logit, clamped to [-100, 100].",
    ),
    SamplingField(
        "min_tokens",
        _integer(minimum=0),
        "End-of-sequence and stop_token_ids cannot end the generation before this many tokens.",
    ),
    # The router cannot map text-named logprobs of another daemon back to token ids.
    SamplingField(
        "logprobs",
        _integer(minimum=0, maximum=MAX_LOGPROBS),
        "Each sampled token's log-probability under the model and this many alternatives "
        "(chat: with logprobs: true; responses: with include message.output_text.logprobs).",
        chat=("top_logprobs",),
        responses=("top_logprobs",),
        remote=False,
    ),
    # No request field: completions' echo with logprobs asks for it.
    SamplingField(
        "prompt_logprobs",
        _integer(minimum=0, maximum=MAX_LOGPROBS),
        "Each prompt token's log-probability and this many alternatives.",
        completion=(),
        chat=(),
        remote=False,
    ),
)
BY_NAME: dict[str, SamplingField] = {f.name: f for f in FIELDS}
# SamplingParams fields without a row, and why: each travels its own way.
NOT_IN_TABLE: dict[str, str] = {
    # Several request fields (response_format, structured_outputs, guided_*) make one value,
    # parsed by core/grammar_spec.py; a remote engine is sent it as structured_outputs.
    "structured": "the output constraint (core/grammar_spec.py)",
    # Set by /v1/embeddings itself (server/embeddings.py), never by a generation request; a
    # remote engine is not sent it (RemoteHandle.supports refuses pooling calls).
    "pooling": "an embedding's pooling (server/embeddings.py)",
}
# generation_config.json keys that set a sampling default, and the Python type each is read as.
GENERATION_CONFIG_KEYS: dict[str, type] = {
    f.name: int if f.schema["type"] == "integer" else float for f in FIELDS if f.model_default
}


def request_names(endpoint: Endpoint) -> frozenset[str]:
    """Every request field of the endpoint that is a sampling field."""
    return frozenset(name for f in FIELDS for name in f.names(endpoint))
