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
            content = join_text_parts(content, f"{where}.content")
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


def join_text_parts(parts: list[Any], where: str, kinds: tuple[str, ...] = ("text",)) -> str:
    """Text parts (``{"type": <one of kinds>, "text"}``) joined by newlines; any other part is a
    400 naming ``where``, the list's path. Chat's kind is ``text``; Responses' items also send
    ``input_text`` and ``output_text``."""
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds or not isinstance(part.get("text"), str):
            text = f"{where}[{j}]: only text parts are supported, got type {kind!r}"
            raise APIError(400, text, param=where)
        texts.append(part["text"])
    return "\n".join(texts)
