"""The chat endpoint's request parsing (``/v1/chat/completions``), on top of protocol.py's shared
parts: its own fields (what is honoured, accepted as a no-op or refused by name), vLLM's options
for rendering the chat template, and the check that a prefilled last message can be continued.
The agents' APIs (responses_protocol.py, messages_protocol.py) reuse the last two. Pure
functions, as protocol.py.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from yaied.core.sampling_fields import request_names
from yaied.server.chat_messages import parse_messages
from yaied.server.errors import APIError
from yaied.server.protocol import (
    _COMMON_FIELDS,
    ParsedRequest,
    _common,
    _get,
    _refuse_unknown_fields,
)
from yaied.server.tool_request import parse_tool_request

# OpenAI chat fields that cannot change the output: accepted (their JSON type checked), ignored.
CHAT_NO_OP_FIELDS: dict[str, tuple[type, ...]] = {
    "store": (bool,),
    "metadata": (dict,),
    "service_tier": (str,),
    "prompt_cache_key": (str,),  # a routing hint; the prefix cache needs none
    "prompt_cache_retention": (str,),  # nor a lifetime
    "prompt_cache_options": (dict,),  # nor breakpoints
    "safety_identifier": (str,),
}
# OpenAI's reasoning efforts: chat's reasoning_effort and Responses' reasoning.effort go to the
# chat template as its `reasoning_effort` variable (gpt-oss's templates read it; others ignore it).
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
# OpenAI chat fields we do not implement: a 400 saying so, not "unrecognized".
_UNSUPPORTED_CHAT = {
    "audio": "audio output",
    "prediction": "predicted outputs",
    "moderation": "moderation",
    "verbosity": "verbosity",
    "web_search_options": "web search",
}
CHAT_FIELDS = frozenset(
    {
        *_COMMON_FIELDS,
        *request_names("chat"),
        *CHAT_NO_OP_FIELDS,
        *_UNSUPPORTED_CHAT,
        "messages",
        "reasoning_effort",  # to the chat template (REASONING_EFFORTS)
        "logprobs",  # whether to return them; top_logprobs says how many alternatives
        "tools",  # tools, tool_choice, parallel_tool_calls: server/tool_request.py
        "tool_choice",
        "parallel_tool_calls",
        "functions",  # the deprecated functions API: a 400 that says to send tools
        "function_call",
        "modalities",  # ["text"] only
        "chat_template_kwargs",  # vLLM's: extra variables for the chat template
        "add_generation_prompt",  # vLLM's: end the prompt with the assistant's turn (default)
        "continue_final_message",  # vLLM's: continue the last message (a prefill)
    }
)
# apply_chat_template's own parameters and the variables it sets: not for chat_template_kwargs.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "self",  # jinja's render(self, ...)
    }
)


def parse_chat(body: dict[str, Any]) -> ParsedRequest:
    _refuse_unknown_fields(body, CHAT_FIELDS)
    _refuse_unimplemented_chat(body)
    parsed = ParsedRequest("chat", None)
    _common(body, parsed)
    parsed.messages = parse_messages(body.get("messages"))
    parsed.tools = parse_tool_request(body)
    options = parse_template_options(body)
    parsed.add_generation_prompt = options.add_generation_prompt
    parsed.continue_final_message = options.continue_final_message
    parsed.chat_template_kwargs = options.kwargs
    effort = _get(body, "reasoning_effort", (str,))
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            text = f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}"
            raise APIError(400, text, param="reasoning_effort")
        # chat_template_kwargs, the more specific, wins where it sets the variable too
        parsed.chat_template_kwargs.setdefault("reasoning_effort", effort)
    check_continuation(parsed, "continue_final_message")
    top_logprobs = parsed.logprobs  # the table's chat name for SamplingParams.logprobs
    if _get(body, "logprobs", (bool,), False):
        parsed.logprobs = 0 if top_logprobs is None else top_logprobs
    elif top_logprobs is not None:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    return parsed


def _refuse_unimplemented_chat(body: dict[str, Any]) -> None:
    for name, what in _UNSUPPORTED_CHAT.items():
        if body.get(name) is not None:
            raise APIError(400, f"{what} is not supported", param=name)
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise APIError(400, 'modalities other than ["text"] are not supported', "modalities")
    for name, kinds in CHAT_NO_OP_FIELDS.items():
        _get(body, name, kinds)


class TemplateOptions(NamedTuple):
    add_generation_prompt: bool
    continue_final_message: bool
    kwargs: dict[str, Any]


def parse_template_options(body: dict[str, Any]) -> TemplateOptions:
    """vLLM's fields for rendering the chat template: ``add_generation_prompt`` (default true,
    false with ``continue_final_message``, which it contradicts) and ``chat_template_kwargs``,
    which become template variables."""
    continue_final = _get(body, "continue_final_message", (bool,), False)
    add_generation_prompt = _get(body, "add_generation_prompt", (bool,), not continue_final)
    if continue_final and add_generation_prompt:
        raise APIError(
            400,
            "continue_final_message continues the last message; add_generation_prompt would "
            "start a new one after it: send add_generation_prompt false, or leave it out",
            param="add_generation_prompt",
        )
    kwargs = _get(body, "chat_template_kwargs", (dict,), {})
    for key in kwargs:
        if not key.isidentifier():
            raise APIError(
                400,
                f"chat_template_kwargs keys must be identifiers, got {key!r}",
                param="chat_template_kwargs",
            )
        if key in _RESERVED_TEMPLATE_KWARGS:
            raise APIError(
                400,
                f"chat_template_kwargs may not set {key!r}: it is a parameter of the template "
                "renderer itself",
                param=f"chat_template_kwargs.{key}",
            )
    return TemplateOptions(add_generation_prompt, continue_final, dict(kwargs))


def check_continuation(parsed: ParsedRequest, param: str) -> None:
    """A continued last message (a prefill) and a grammar that holds the output to a whole
    value (a structured output, a forced tool call) do not mix: the grammar would start that
    value at the first generated token, as if nothing had been prefilled. A last message that
    carries tool calls cannot be continued either: the text would end before its calls."""
    if not parsed.continue_final_message:
        return
    if parsed.structured is not None:
        raise APIError(
            400, "a prefilled last message cannot be combined with a structured output", param
        )
    if parsed.tools.active and parsed.tools.choice.mode == "required":
        raise APIError(
            400, "a prefilled last message cannot be combined with a forced tool call", param
        )
    if parsed.messages and parsed.messages[-1].get("tool_calls"):
        raise APIError(400, "the message to continue carries tool calls: it is complete", param)
