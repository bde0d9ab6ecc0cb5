"""OpenAI request parsing: JSON bodies to prompts and sampling keywords. Pure functions.

The chat endpoint's own fields, template options and prefill check are in chat_protocol.py;
what every endpoint shares (the parsed request, field checks, sampling, structured outputs) and
the completion, tokenize and detokenize bodies are here.

Parsing checks shapes and JSON types and names the offending field; value ranges are
SamplingParams' job (its ValueErrors become 400s in errors.from_value_error), so each rule lives
in one place. Every field is either honoured, accepted because it cannot change the output
(``store``, ``metadata``... : type-checked, then ignored), or refused with a 400 naming it:
unknown fields as OpenAI refuses them, fields we know but do not implement (yet) with a message
that says so. Nothing a client sends is silently dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

from yaied.core import sampling_fields
from yaied.core.grammar_spec import GrammarSpec, StructuredOutputError, parse_structured_output
from yaied.core.sampling_fields import Endpoint, request_names
from yaied.server.chat_messages import parse_messages
from yaied.server.errors import APIError
from yaied.server.tool_request import ToolRequest

Prompt = str | list[int]

# Sampling fields come from the table (core/sampling_fields.py); these are the call's own.
_COMMON_FIELDS = {
    "model",
    "n",
    "stream",
    "stream_options",
    "user",
    "priority",
    # Structured outputs (core/grammar_spec.py parses them into one GrammarSpec): OpenAI's field,
    # vLLM's current one and its older aliases, on both endpoints.
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",  # "xgrammar" or "auto" only: the one backend there is
    "guided_whitespace_pattern",  # refused: JSON whitespace is fixed (see the README)
}
COMPLETION_FIELDS = frozenset(
    {
        *_COMMON_FIELDS,
        *request_names("completion"),
        *("prompt", "echo", "best_of", "suffix", "return_token_ids", "resume_token_ids"),
    }
)
_GRAMMAR_BACKENDS = ("xgrammar", "auto")
STREAM_OPTIONS = frozenset({"include_usage", "include_obfuscation"})  # the latter is ignored


@dataclass(slots=True)
class ParsedRequest:
    """One API call: its prompts (chat: the messages, to be templated) and sampling keywords."""

    kind: Literal["completion", "chat"]
    model: str | None
    prompts: list[Prompt] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    sampling: dict[str, Any] = field(default_factory=dict)
    max_tokens: int | None = None  # None: chat's default, what the context has left
    # Messages: a max_tokens past what the context has left is cut to it, not refused (as
    # Anthropic's current models run to the window's end), see messages_api's stop reasons
    max_tokens_to_context: bool = False
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    logprobs: int | None = None  # top-N per sampled token; None: no logprobs
    priority: int = 0
    user: str | None = None
    return_token_ids: bool = False  # completions: each choice carries its sampled token ids
    # completions, yaied's own: output a router already sent for this call on another engine;
    # the call resumes after it (router/manager.py), and streams only what follows.
    resume_token_ids: list[int] = field(default_factory=list)
    add_generation_prompt: bool = True  # chat
    # chat: the prompt ends inside the last message, which the output continues (a prefill)
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # chat
    structured: GrammarSpec | None = None  # the output constraint; None: free text
    # chat, once output_grammar wraps `structured` in a structural tag (tools, reasoning): the
    # request's own constraint (response_format), to name it when the tag does not compile
    own_structured: GrammarSpec | None = None
    tools: ToolRequest = field(default_factory=ToolRequest)  # chat: tools and tool_choice


# The sampling fields ParsedRequest holds itself rather than in ``sampling``: max_tokens, logprobs.
_PARSED_FIELDS = frozenset(f.name for f in fields(ParsedRequest)) & set(sampling_fields.BY_NAME)


def _get(body: dict[str, Any], name: str, kinds: tuple[type, ...], default: Any = None) -> Any:
    """The field's value (None and absent read as the default), or a 400 naming it."""
    value = body.get(name)
    if value is None:
        return default
    is_bool = isinstance(value, bool)
    if bool in kinds and is_bool:
        return value
    if is_bool or not isinstance(value, kinds):
        names = " or ".join(k.__name__ for k in kinds).replace("float", "number")
        raise APIError(400, f"{name} must be {names}, got {value!r}", param=name)
    return value


def _refuse_unknown_fields(body: dict[str, Any], known: frozenset[str]) -> None:
    """A 400 naming every field the endpoint does not know (as OpenAI: param is the first)."""
    unknown = sorted(set(body) - known)
    if unknown:
        plural = "s" if len(unknown) > 1 else ""
        raise APIError(
            400,
            f"Unrecognized request argument{plural} supplied: {', '.join(unknown)}",
            param=unknown[0],
            code="unknown_parameter",
        )


def _structured_output(body: dict[str, Any]) -> GrammarSpec | None:
    """The output constraint, checked for shape here; whether it compiles is decided (with its
    own 400) when the server compiles it, before anything is queued."""
    backend = _get(body, "guided_decoding_backend", (str,))
    if backend is not None and backend not in _GRAMMAR_BACKENDS:
        message = f"guided_decoding_backend must be one of {', '.join(_GRAMMAR_BACKENDS)}"
        raise APIError(400, message, param="guided_decoding_backend")
    if body.get("guided_whitespace_pattern") is not None:
        raise APIError(
            400,
            "guided_whitespace_pattern is not supported: JSON is written on one line",
            param="guided_whitespace_pattern",
        )
    try:
        return parse_structured_output(body)
    except StructuredOutputError as exc:
        raise APIError(400, exc.message, param=exc.param) from None


def _common(body: dict[str, Any], parsed: ParsedRequest) -> None:
    parsed.model = _get(body, "model", (str,))
    parsed.n = _get(body, "n", (int,), 1)
    if parsed.n < 1:  # the upper bound is server.max_n (server/limits.py)
        raise APIError(400, f"n must be at least 1, got {parsed.n}", param="n")
    parsed.stream = _get(body, "stream", (bool,), False)
    options = _get(body, "stream_options", (dict,), {})
    extra = sorted(set(options) - STREAM_OPTIONS)
    if extra:
        raise APIError(
            400, f"stream_options.{extra[0]} is not supported", f"stream_options.{extra[0]}"
        )
    parsed.include_usage = bool(_get(options, "include_usage", (bool,), False))
    _get(options, "include_obfuscation", (bool,))
    if options and not parsed.stream:
        raise APIError(400, "stream_options needs stream: true", param="stream_options")
    parsed.structured = _structured_output(body)
    parsed.user = _get(body, "user", (str,))
    parsed.priority = _get(body, "priority", (int,), 0)
    parse_sampling(body, parsed)


def parse_sampling(
    body: dict[str, Any], parsed: ParsedRequest, endpoint: Endpoint | None = None
) -> None:
    """Every sampling field the endpoint names, type-checked by its schema's JSON type. A field
    ParsedRequest declares (max_tokens, logprobs) goes there, its endpoint default when absent:
    the server finishes it (chat's max_tokens, echo's prompt_logprobs). The rest go to
    ``parsed.sampling``, absent ones left to SamplingParams and the model's defaults.
    ``endpoint``: the API whose names the body uses (the agents' APIs run as chat)."""
    endpoint = endpoint or parsed.kind
    for spec in sampling_fields.FIELDS:
        value = None
        for name in spec.names(endpoint):
            value = _get(body, name, spec.json_types)
            if value is not None:
                if spec.name in _NORMALIZE:
                    value = _NORMALIZE[spec.name](value, name)
                break
        if spec.name in _PARSED_FIELDS:
            setattr(parsed, spec.name, spec.default(endpoint) if value is None else value)
        elif value is not None:
            parsed.sampling[spec.name] = value


def _stop_strings(value: str | list[Any], name: str) -> list[str]:
    stop = [value] if isinstance(value, str) else value
    if not all(isinstance(s, str) for s in stop):
        raise APIError(400, f"{name} must be a string or a list of strings", param=name)
    return stop


# Sampling fields whose values need more than their JSON type checked.
_NORMALIZE = {"stop": _stop_strings}


def parse_completion(body: dict[str, Any]) -> ParsedRequest:
    _refuse_unknown_fields(body, COMPLETION_FIELDS)
    if _get(body, "suffix", (str,)):
        raise APIError(400, "suffix is not supported", param="suffix")
    if _get(body, "best_of", (int,), 1) > 1:
        raise APIError(400, "best_of > 1 is not supported", param="best_of")
    parsed = ParsedRequest("completion", None)
    _common(body, parsed)
    parsed.prompts = parse_prompts(body.get("prompt"))
    parsed.echo = _get(body, "echo", (bool,), False)
    parsed.return_token_ids = _get(body, "return_token_ids", (bool,), False)
    parsed.resume_token_ids = _get(body, "resume_token_ids", (list,), [])
    if not all(_is_token_id(t) for t in parsed.resume_token_ids):
        raise APIError(400, "resume_token_ids must be token ids", param="resume_token_ids")
    if parsed.resume_token_ids and (parsed.n != 1 or parsed.echo or len(parsed.prompts) != 1):
        raise APIError(
            400, "resume_token_ids needs one prompt, n 1 and no echo", param="resume_token_ids"
        )
    return parsed


def parse_prompts(prompt: Any) -> list[Prompt]:
    """A string, a list of strings, a token-id list, or a list of token-id lists."""
    message = "prompt must be a string, a list of strings, or token ids (a list or list of lists)"
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise APIError(400, message if prompt is not None else "prompt is required", "prompt")
    if all(_is_token_id(t) for t in prompt):
        return [prompt]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, list) and p and all(_is_token_id(t) for t in p) for p in prompt):
        return list(prompt)
    raise APIError(400, message, param="prompt")


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_tokenize(
    body: dict[str, Any],
) -> tuple[list[Prompt] | None, list[dict[str, Any]], bool]:
    """/tokenize takes a prompt (a string, with ``add_special_tokens``, default true) or chat
    messages (then also the chat endpoint's template options:
    chat_protocol.parse_template_options); returns prompts, messages, add_special_tokens."""
    if body.get("messages") is not None:
        return None, parse_messages(body["messages"]), False
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise APIError(400, "prompt (a string) or messages is required", param="prompt")
    return [prompt], [], _get(body, "add_special_tokens", (bool,), True)


def parse_detokenize(body: dict[str, Any]) -> list[int]:
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(_is_token_id(t) for t in tokens):
        raise APIError(400, "tokens must be a list of token ids", param="tokens")
    return tokens
