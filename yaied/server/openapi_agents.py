"""The OpenAPI paths of the agents' APIs: /v1/responses, /v1/conversations, /v1/messages,
/v1/embeddings.

Their sampling fields come from the one table (core/sampling_fields.py, endpoints "responses"
and "messages"), as the OpenAI endpoints' do; the rest is each API's own request shape, closed
(other fields are refused), so the schema-driven fuzzer (tests/server/test_schemathesis.py)
sends both what the parsers accept and what they must refuse.
"""

from __future__ import annotations

from typing import Any

from yaied.core import sampling_fields

_TEXT_OR_PARTS = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]}
_TOKENS = {"type": "array", "items": {"type": "integer"}}


def _sampling(endpoint: sampling_fields.Endpoint) -> dict[str, Any]:
    return {
        name: spec.schema_for(endpoint)
        for spec in sampling_fields.FIELDS
        for name in spec.names(endpoint)
    }


_RESPONSES = {
    **_sampling("responses"),
    "model": {"type": "string"},
    "input": {
        "oneOf": [
            {"type": "string"},
            {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "type": {
                            "type": "string",
                            "enum": [
                                "message",
                                "function_call",
                                "function_call_output",
                                "custom_tool_call",
                                "custom_tool_call_output",
                                "item_reference",
                            ],
                        },  # fmt: skip
                        "id": {"type": "string"},
                        "role": {"type": "string", "enum": ["user", "assistant", "system"]},
                        "content": _TEXT_OR_PARTS,
                        "call_id": {"type": "string"},
                        "name": {"type": "string"},
                        "arguments": {"type": "string"},
                        "output": _TEXT_OR_PARTS,
                    },
                },
            },
        ]
    },
    "instructions": {"type": "string"},
    "tools": {"type": "array", "items": {"type": "object"}},
    "tool_choice": {"oneOf": [{"type": "string"}, {"type": "object"}]},
    "parallel_tool_calls": {"type": "boolean"},
    "text": {"type": "object", "properties": {"format": {"type": "object"}}},
    "reasoning": {"type": "object", "properties": {"effort": {"type": "string"}}},
    "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
    "store": {"type": "boolean"},
    "previous_response_id": {"type": "string"},
    "stream": {"type": "boolean"},
    "user": {"type": "string"},
    "truncation": {"type": "string", "enum": ["disabled", "auto"]},
    "prompt_cache_key": {"type": "string"},
    "prompt_cache_retention": {"type": "string", "enum": ["in_memory", "24h"]},
    "background": {"type": "boolean"},
    "conversation": {"oneOf": [{"type": "string"}, {"type": "object"}]},
    "include": {"type": "array", "items": {"type": "string"}},
    "max_tool_calls": {"type": "integer", "minimum": 1},
    "client_metadata": {"type": "object"},
}
_MESSAGES = {
    **_sampling("messages"),
    "model": {"type": "string"},
    "messages": {
        "type": "array",
        "items": {
            "type": "object",
            "required": ["role", "content"],
            "properties": {
                # system: a mid-conversation system message (never the first)
                "role": {"type": "string", "enum": ["user", "assistant", "system"]},
                "content": _TEXT_OR_PARTS,
            },
        },
    },
    "system": _TEXT_OR_PARTS,
    "tools": {"type": "array", "items": {"type": "object"}},
    "tool_choice": {"type": "object"},
    "thinking": {"type": "object"},
    "metadata": {"type": "object"},
    "output_config": {"type": "object"},
    "context_management": {"type": "object", "properties": {"edits": {"type": "array"}}},
    "stream": {"type": "boolean"},
}
_EMBEDDINGS = {
    "model": {"type": "string"},
    "input": {
        "oneOf": [
            {"type": "string"},
            {"type": "array", "items": {"type": "string"}},
            _TOKENS,
            {"type": "array", "items": _TOKENS},
        ]
    },
    "encoding_format": {"type": "string", "enum": ["float", "base64"]},
    "pooling": {"type": "string", "enum": ["mean", "last"]},
    "user": {"type": "string"},
}


def _post(summary: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    schema = {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
            "responses": {"200": {"description": "JSON, or text/event-stream when streaming"}},
        }
    }


def _by_id(summary: str) -> dict[str, Any]:
    schema = {"type": "string"}
    parameter = {"name": "response_id", "in": "path", "required": True, "schema": schema}
    answer = {"200": {"description": "JSON"}, "404": {"description": "not stored for this key"}}
    return {
        method: {"summary": f"{summary} {what}", "parameters": [parameter], "responses": answer}
        for method, what in (("get", "(read)"), ("delete", "(delete)"))
    }


def _input_items() -> dict[str, Any]:
    path = {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}
    query = [
        {
            "name": "limit",
            "in": "query",
            "schema": {"type": "integer", "minimum": 1, "maximum": 100},
        },
        {"name": "order", "in": "query", "schema": {"type": "string", "enum": ["asc", "desc"]}},
        {"name": "after", "in": "query", "schema": {"type": "string"}},
        {"name": "before", "in": "query", "schema": {"type": "string"}},
    ]
    answer = {
        "200": {"description": "a list object"},
        "400": {"description": "a bad page parameter"},
        "404": {"description": "not stored for this key"},
    }
    summary = "A stored response's input items, a page at a time"
    return {"get": {"summary": summary, "parameters": [path, *query], "responses": answer}}


def _cancel() -> dict[str, Any]:
    path = {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}
    answer = {
        "200": {"description": "the response, cancelled (or as it ended)"},
        "400": {"description": "not a background response"},
        "404": {"description": "not stored for this key"},
    }
    summary = "Cancel a background response"
    return {"post": {"summary": summary, "parameters": [path], "responses": answer}}


def _conversation_paths() -> dict[str, Any]:
    """/v1/conversations and its items (conversations_api.py)."""
    ident = {
        "name": "conversation_id",
        "in": "path",
        "required": True,
        "schema": {"type": "string"},
    }
    item = {"name": "item_id", "in": "path", "required": True, "schema": {"type": "string"}}
    answer = {"200": {"description": "JSON"}, "404": {"description": "not stored for this key"}}
    items = {"type": "array", "maxItems": 20, "items": _RESPONSES["input"]["oneOf"][1]["items"]}
    metadata = _RESPONSES["metadata"]

    def op(summary: str, parameters: list, body: dict | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"summary": summary, "parameters": parameters, "responses": answer}
        if body is not None:
            schema = {"type": "object", "properties": body, "additionalProperties": False}
            out["requestBody"] = {"content": {"application/json": {"schema": schema}}}
        return out

    listing = _input_items()["get"]["parameters"][1:]
    return {
        "/v1/conversations": {
            "post": op("Create a conversation", [], {"items": items, "metadata": metadata})
        },
        "/v1/conversations/{conversation_id}": {
            "get": op("A conversation", [ident]),
            "post": op("Update a conversation's metadata", [ident], {"metadata": metadata}),
            "delete": op("Delete a conversation", [ident]),
        },
        "/v1/conversations/{conversation_id}/items": {
            "get": op("A conversation's items, a page at a time", [ident, *listing]),
            "post": op("Append items", [ident], {"items": items}),
        },
        "/v1/conversations/{conversation_id}/items/{item_id}": {
            "get": op("One item", [ident, item]),
            "delete": op("Delete one item (returns the conversation)", [ident, item]),
        },
    }


# count_tokens' fields: the prompt's, and those the client sends beside them
_COUNTED = ("model", "messages", "system", "tools", "tool_choice", "thinking", "output_config",
            "context_management")  # fmt: skip


def agent_paths() -> dict[str, Any]:
    return {
        **_conversation_paths(),
        "/v1/responses": _post("OpenAI Responses API (stateful with store)", _RESPONSES, ["input"]),
        "/v1/responses/{response_id}": _by_id("A stored response"),
        "/v1/responses/{response_id}/input_items": _input_items(),
        "/v1/responses/{response_id}/cancel": _cancel(),
        "/v1/messages": _post(
            "Anthropic Messages API (errors in Anthropic's shape)",
            _MESSAGES,
            ["messages", "max_tokens"],
        ),
        "/v1/messages/count_tokens": _post(
            "The prompt's token count for a Messages request",
            {k: _MESSAGES[k] for k in _COUNTED},
            ["messages"],
        ),
        "/v1/embeddings": _post("Pooled, normalised hidden states", _EMBEDDINGS, ["input"]),
    }
