"""A chat's messages as the chat templates take them: OpenAI's message objects (as chat
completions, Responses and Messages requests carry them, after their own conversion) checked
and flattened. Pure functions; the 400s name the offending message."""

from __future__ import annotations

from typing import Any

from yaied.server.errors import APIError
from yaied.server.tool_request import parse_tool_calls_field


def parse_messages(messages: Any) -> list[dict[str, Any]]:
    """Messages with their content flattened to a string (text parts joined; null is ""), and
    what tool calling adds: an assistant's ``tool_calls``, a tool result's ``tool_call_id``, a
    participant's ``name``."""
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list", param="messages")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise APIError(400, f"{where} must be an object with a string role", param=where)
        role = message["role"]
        if role == "function":
            raise APIError(
                400, f"{where}: the 'function' role is deprecated; send 'tool' results", where
            )
        content = message.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            content = _text_parts(content, where)
        elif not isinstance(content, str):
            raise APIError(400, f"{where}.content must be a string or a list of parts", where)
        item: dict[str, Any] = {"role": role, "content": content}
        if isinstance(message.get("name"), str):
            item["name"] = message["name"]
        if role == "assistant" and message.get("tool_calls") is not None:
            item["tool_calls"] = parse_tool_calls_field(message["tool_calls"], where)
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str):
                param = f"{where}.tool_call_id"
                raise APIError(400, f"{param} is required (a string)", param=param)
            item["tool_call_id"] = call_id
        out.append(item)
    return out


def _text_parts(parts: list[Any], where: str) -> str:
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise APIError(
                400,
                f"{where}.content[{j}]: only text parts are supported, got type {kind!r}",
                param=f"{where}.content",
            )
        texts.append(part["text"])
    return "\n".join(texts)
