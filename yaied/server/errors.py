"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with the right status.

Handlers raise APIError anywhere; one exception handler turns it into the body. ValueErrors from
SamplingParams and the engine's InputProcessor become 400s, their parameter named where the
message lets us tell.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

import orjson
from starlette.responses import Response

from yaied.core import sampling_fields
from yaied.core.errors import ContextLengthError
from yaied.core.sampling_fields import Endpoint

log = logging.getLogger(__name__)

# Status -> OpenAI's error type string.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    403: "permission_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}

# Parameters a ValueError message may start with (SamplingParams names the field it refuses),
# longest first so "top_p" wins over "top".
_PARAMS = sorted(sampling_fields.BY_NAME, key=len, reverse=True)


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


def request_aliases(endpoint: Endpoint) -> dict[str, str]:
    """SamplingParams names -> the endpoint's request names where they differ (chat's
    ``max_completion_tokens``, ``top_logprobs``): the ``aliases`` of ``from_value_error``."""
    aliases = {}
    for spec in sampling_fields.FIELDS:
        names = spec.names(endpoint)
        if names and names[0] != spec.name:
            aliases[spec.name] = names[0]
    return aliases


def from_value_error(exc: ValueError, aliases: dict[str, str] | None = None) -> APIError:
    """A 400 naming the parameter the message is about; ``aliases`` maps our sampling names to
    the request's (``request_aliases``)."""
    message = str(exc)
    param = getattr(exc, "param", None)  # an InputError names its field itself
    if param is None:
        param = next((p for p in _PARAMS if message.startswith(p)), None)
    if param is None and ("context length" in message or "prompt" in message):
        param = "prompt"
    if param is not None and aliases:
        param = aliases.get(param, param)
    code = "context_length_exceeded" if isinstance(exc, ContextLengthError) else None
    return APIError(400, message, param=param, code=code)


# What an exception's text looks like inside an error message: "KeyError: 'x'", "ConnectError(..)",
# a traceback's lines. Engine messages meant for clients ("non-finite values", "the engine stopped:
# a step ran past engine.step_timeout_s") have none of these.
_EXCEPTION_TEXT = re.compile(
    r"\b[A-Z]\w*(Error|Exception|Exit|Interrupt|Warning|Failure)\b\s*[:(]"
    r"|Traceback \(most recent call last\)|File \"[^\"]*\", line \d+"
)


def public_error(what: str, error: str | None, request_id: str) -> str:
    """The message a client gets for a failed generation: the engine's own words, unless they
    carry an exception's text, which goes to the log with the request id instead."""
    error = error or "unknown error"
    if _EXCEPTION_TEXT.search(error) is None:
        return f"{what}: {error}"
    log.error("%s: %s: %s", request_id, what, error)
    return f"{what}: an internal error; the server log has it under request id {request_id}"
