"""A hand-written OpenAPI schema: the endpoints and the request fields we accept.

OpenAPI 3.0 takes JSON Schema draft 4's bounds: ``exclusiveMinimum`` is a boolean beside
``minimum`` (a number there is a 3.1-ism that 3.0 validators reject).
"""

from __future__ import annotations

from typing import Any

from yaied.core import sampling_fields
from yaied.core.sampling_fields import Endpoint
from yaied.server.openapi_agents import agent_paths

# The call's own fields; the sampling fields come from core/sampling_fields.py.
_COMMON = {
    "model": {"type": "string"},
    "n": {"type": "integer", "minimum": 1},
    "stream": {"type": "boolean"},
    "stream_options": {
        "type": "object",
        "properties": {
            "include_usage": {"type": "boolean"},
            "include_obfuscation": {"type": "boolean"},  # accepted, ignored
        },
        "additionalProperties": False,
    },
    "priority": {"type": "integer"},
    "user": {"type": "string"},
}
# Structured outputs (core/grammar_spec.py): at most one constraint per request.
_SCHEMA_VALUE = {"oneOf": [{"type": "object"}, {"type": "string"}]}  # a schema, or its JSON text
_STRINGS = {"type": "array", "items": {"type": "string"}, "minItems": 1}
_STRUCTURED = {
    "response_format": {
        "oneOf": [
            {
                "type": "object",
                "properties": {"type": {"type": "string", "enum": ["text", "json_object"]}},
                "required": ["type"],
                "additionalProperties": False,
            },
            {
                "type": "object",
                "properties": {
                    "type": {"type": "string", "enum": ["json_schema"]},
                    "json_schema": {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string"},
                            "description": {"type": "string"},
                            "strict": {"type": "boolean"},
                            "schema": {"type": "object"},
                        },
                        "required": ["schema"],
                    },
                },
                "required": ["type", "json_schema"],
                "additionalProperties": False,
            },
        ],
    },
    "structured_outputs": {
        "type": "object",
        "description": "vLLM's field: exactly one of json, regex, choice, grammar, json_object, "
        "structural_tag.",
        "properties": {
            "json": _SCHEMA_VALUE,
            "regex": {"type": "string"},
            "choice": _STRINGS,
            "grammar": {"type": "string", "description": "EBNF (xgrammar's dialect)"},
            "json_object": {"type": "boolean"},
            "structural_tag": {
                "description": "xgrammar's structural tag: an object or its JSON text",
                "oneOf": [{"type": "object"}, {"type": "string"}],
            },
        },
        "additionalProperties": False,
    },
    "guided_json": _SCHEMA_VALUE,
    "guided_regex": {"type": "string"},
    "guided_choice": _STRINGS,
    "guided_grammar": {"type": "string"},
    "guided_decoding_backend": {"type": "string", "enum": ["xgrammar", "auto"]},
}


def sampling_properties(endpoint: Endpoint) -> dict[str, Any]:
    """Every request name of every sampling field on the endpoint, with the field's schema."""
    return {
        name: spec.schema_for(endpoint)
        for spec in sampling_fields.FIELDS
        for name in spec.names(endpoint)
    }


_TOKENS = {"type": "array", "items": {"type": "integer"}}
_COMPLETION = {
    **_COMMON,
    **_STRUCTURED,
    **sampling_properties("completion"),
    "prompt": {
        "oneOf": [
            {"type": "string"},
            {"type": "array", "items": {"type": "string"}},
            _TOKENS,
            {"type": "array", "items": _TOKENS},
        ]
    },
    "echo": {"type": "boolean"},
    "return_token_ids": {"type": "boolean"},
    "resume_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0}},
}
_MESSAGES = {
    "type": "array",
    "items": {
        "type": "object",
        "required": ["role"],
        "properties": {"role": {"type": "string"}, "content": {}},
    },
}
_CHAT = {
    **_COMMON,
    **_STRUCTURED,
    **sampling_properties("chat"),
    "messages": _MESSAGES,
    "logprobs": {"type": "boolean"},  # whether to return them; top_logprobs: how many others
    "add_generation_prompt": {"type": "boolean"},
    "continue_final_message": {"type": "boolean"},
    "chat_template_kwargs": {"type": "object"},
    "reasoning_effort": {
        "type": "string",
        "enum": ["none", "minimal", "low", "medium", "high", "xhigh", "max"],
    },
    "modalities": {"type": "array", "items": {"type": "string", "enum": ["text"]}},
    # Accepted and ignored: they cannot change the output.
    "store": {"type": "boolean"},
    "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
    "service_tier": {"type": "string"},
    "parallel_tool_calls": {"type": "boolean"},
    "prompt_cache_key": {"type": "string"},
    "prompt_cache_retention": {"type": "string", "enum": ["in_memory", "24h"]},
    "safety_identifier": {"type": "string"},
}


def _post(
    summary: str, properties: dict[str, Any], required: list[str], *, closed: bool = False
) -> dict[str, Any]:
    """``closed``: other fields are refused (a 400 naming them), as the generation endpoints do."""
    schema: dict[str, Any] = {"type": "object", "properties": properties, "required": required}
    if closed:
        schema["additionalProperties"] = False
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
            "responses": {"200": {"description": "JSON, or text/event-stream when streaming"}},
        }
    }


def _get(summary: str, media: str = "application/json") -> dict[str, Any]:
    return {"get": {"summary": summary, "responses": {"200": {"description": media}}}}


def _cancel(summary: str, param: str) -> dict[str, Any]:
    """A cancel route: no body, the id in the path."""
    parameter = {"name": param, "in": "path", "required": True, "schema": {"type": "string"}}
    return {
        "post": {
            "summary": summary,
            "parameters": [parameter],
            "responses": {"200": {"description": "JSON: the id and how many calls were cancelled"}},
        }
    }


def _engine_change(method: str, summary: str) -> dict[str, Any]:
    parameter = {"name": "engine_id", "in": "path", "required": True, "schema": {"type": "string"}}
    responses = {"200": {"description": "JSON: the engine"}, "403": {"description": "not admin"}}
    return {method: {"summary": summary, "parameters": [parameter], "responses": responses}}


# POST /v1/engines: an [[engines]] table (router/config.py EngineEntry) as JSON; the settings
# below, and any other the table takes (tensor_parallel_size where engines have it).
_ENGINE = {
    "kind": {"type": "string", "enum": ["local", "remote"]},
    "name": {"type": "string"},
    "device": {"type": "string"},
    "threads": {"type": "integer", "minimum": 0},
    "url": {"type": "string"},
    "api_key": {"type": "string"},
}


def openapi_schema(version: str) -> dict[str, Any]:
    return {
        "openapi": "3.0.3",
        "info": {"title": "yaied", "version": version},
        "paths": {
            "/v1/completions": _post("Text completion", _COMPLETION, ["prompt"], closed=True),
            "/v1/chat/completions": _post("Chat completion", _CHAT, ["messages"], closed=True),
            **agent_paths(),
            "/v1/models": _get("The served model"),
            "/tokenize": _post(
                "Prompt or messages to token ids",
                {
                    "model": {"type": "string"},
                    "prompt": {"type": "string"},
                    "add_special_tokens": {"type": "boolean"},
                    "messages": _MESSAGES,
                    "add_generation_prompt": {"type": "boolean"},
                    "continue_final_message": {"type": "boolean"},
                    "chat_template_kwargs": {"type": "object"},
                },
                [],
            ),
            "/detokenize": _post(
                "Token ids to text", {"model": {"type": "string"}, "tokens": _TOKENS}, ["tokens"]
            ),
            "/tokenizer_info": _get("The tokenizer's special tokens and chat template"),
            "/health": _get(
                "200 when an engine is up, else 503 with a status: starting, restarting, dead "
                "or draining"
            ),
            "/metrics": _get("Prometheus metrics", "text/plain"),
            "/openapi.json": _get("This schema"),
            "/v1/requests/{request_id}/cancel": _cancel(
                "Cancel every running request whose X-Request-Id is exactly this", "request_id"
            ),
            "/v1/sessions/{session_id}/cancel": _cancel(
                "Cancel every request of a session (its X-Session-Id)", "session_id"
            ),
            "/v1/engines": {
                **_get("The engines behind the router: state, health, load, hit rate"),
                **_post(
                    "Add an engine (admin key): a local one's device and threads, or a remote "
                    "daemon's url and api_key; 202",
                    _ENGINE,
                    [],
                ),
            },
            "/v1/engines/{engine_id}/drain": _engine_change(
                "post", "Stop routing new calls to an engine (admin key)"
            ),
            "/v1/engines/{engine_id}": _engine_change(
                "delete", "Drain an engine, then stop it (admin key); ?timeout= seconds; 202"
            ),
        },
    }
