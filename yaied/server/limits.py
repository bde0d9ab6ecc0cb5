"""Per-request limits from `[server]`: choices, prompts x n, ids, stops, output and prompt length,
each a clear 400.

The engine already refuses what cannot run (a prompt plus max_tokens beyond the context); these
are the operator's tighter bounds on what one client may ask of a shared daemon. They are checked
after parsing and tokenizing and before anything is queued.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from yaied.core.ids import MAX_ID_CHARS
from yaied.core.request import MAX_STOP_TOKEN_IDS, check_stop_strings
from yaied.server.config import ServerConfig
from yaied.server.errors import APIError
from yaied.server.protocol import ParsedRequest


@dataclass(frozen=True, slots=True)
class RequestLimits:
    max_prompt_tokens: int = 0  # 0: the model's context is the only bound
    max_tokens: int = 0  # 0: no bound beyond the context
    max_n: int = 128
    max_jobs: int = 256  # prompts x n: engine calls one request may start

    @classmethod
    def from_config(cls, config: ServerConfig) -> RequestLimits:
        return cls(
            config.max_prompt_tokens,
            config.max_tokens_limit,
            config.max_n,
            config.max_jobs_per_request,
        )

    def check_parsed(self, parsed: ParsedRequest, body: dict[str, Any]) -> None:
        """What the request asks for, before any of it is tokenized: n and prompts x n, client
        ids, stop strings and ids (each a 400), and max_tokens: a 400 when the client asked for
        more, capped when it was our default (completions' 16; chat's rest of the context is
        capped in default_max_tokens)."""
        if parsed.n > self.max_n:
            message = f"n must be at most {self.max_n}, got {parsed.n}"
            raise APIError(400, message, param="n", code="n_too_large")
        num_jobs = max(len(parsed.prompts), 1) * parsed.n
        if num_jobs > self.max_jobs:
            raise APIError(
                400,
                f"this request asks for {num_jobs} completions (prompts x n), more than this "
                f"server's limit of {self.max_jobs} per request",
                param="n" if parsed.n > 1 else "prompt",
                code="too_many_completions",
            )
        check_client_ids(body)
        _check_stops(parsed.sampling)
        if not self.max_tokens or parsed.max_tokens is None:
            return
        names = (
            ("max_completion_tokens", "max_tokens") if parsed.kind == "chat" else ("max_tokens",)
        )
        param = next((name for name in names if body.get(name) is not None), None)
        if param is None:
            parsed.max_tokens = min(parsed.max_tokens, self.max_tokens)
        elif parsed.max_tokens > self.max_tokens:
            raise APIError(
                400,
                f"{param} must be at most {self.max_tokens}, got {parsed.max_tokens}",
                param=param,
                code="max_tokens_too_large",
            )

    def check_prompt(self, num_tokens: int, param: str) -> None:
        if self.max_prompt_tokens and num_tokens > self.max_prompt_tokens:
            raise APIError(
                400,
                f"the prompt has {num_tokens} tokens, more than this server's limit of "
                f"{self.max_prompt_tokens}",
                param=param,
                code="prompt_too_long",
            )

    def default_max_tokens(self, rest_of_context: int) -> int:
        """Chat's max_tokens when none is given: the rest of the context, under the cap."""
        return min(rest_of_context, self.max_tokens) if self.max_tokens else rest_of_context


# The body's fields that name the client or its work: bounded as the id headers are.
CLIENT_ID_FIELDS = ("user", "safety_identifier", "prompt_cache_key")


def check_client_ids(body: dict[str, Any]) -> None:
    for name in CLIENT_ID_FIELDS:
        value = body.get(name)
        if isinstance(value, str) and len(value) > MAX_ID_CHARS:
            message = f"{name} may be at most {MAX_ID_CHARS} characters, got {len(value)}"
            raise APIError(400, message, param=name)


def _check_stops(sampling: dict[str, Any]) -> None:
    """SamplingParams checks these too, but only after every prompt is tokenized."""
    try:
        check_stop_strings(sampling.get("stop") or ())
    except ValueError as exc:
        raise APIError(400, str(exc), param="stop") from None
    ids = sampling.get("stop_token_ids") or ()
    if len(ids) > MAX_STOP_TOKEN_IDS:
        message = f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}"
        raise APIError(400, message, param="stop_token_ids")
