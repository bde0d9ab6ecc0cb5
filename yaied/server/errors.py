"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with the right status.

Handlers raise APIError anywhere; one exception handler turns it into the body. ValueErrors from
SamplingParams and the engine's InputProcessor become 400s, their parameter named where the
message lets us tell.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import orjson
from starlette.responses import Response

# Status -> OpenAI's error type string.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}

# Parameters a ValueError message may start with, longest first so "top_p" wins over "top".
_PARAMS = sorted(
    [
        *("max_tokens", "temperature", "top_p", "top_k", "min_p", "ignore_eos", "seed"),
        *("stop_token_ids", "stop", "presence_penalty", "frequency_penalty", "logit_bias"),
        *("repetition_penalty", "min_tokens", "prompt_logprobs", "logprobs"),
        *("include_stop_str_in_output", "skip_special_tokens"),
    ],
    key=len,
    reverse=True,
)


@dataclass(slots=True)
class APIError(Exception):
    status: int
    message: str
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def body(self) -> dict[str, object]:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> Response:
        return json_response(self.body(), self.status, self.headers)


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, object]:
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code or status}}


def json_response(
    content: object, status: int = 200, headers: dict[str, str] | None = None
) -> Response:
    return Response(
        orjson.dumps(content), status_code=status, headers=headers, media_type="application/json"
    )


def from_value_error(exc: ValueError, aliases: dict[str, str] | None = None) -> APIError:
    """A 400 naming the parameter the message is about; ``aliases`` maps our sampling names to
    the request's (chat's ``max_completion_tokens``, ``top_logprobs``)."""
    message = str(exc)
    param = getattr(exc, "param", None)  # an InputError names its field itself
    if param is None:
        param = next((p for p in _PARAMS if message.startswith(p)), None)
    if param is None and ("context length" in message or "prompt" in message):
        param = "prompt"
    if param is not None and aliases:
        param = aliases.get(param, param)
    return APIError(400, message, param=param)
