"""Errors every layer raises and the server turns into HTTP statuses."""

from __future__ import annotations


class InputError(ValueError):
    """A request the model cannot take (a bad prompt, messages the chat template refuses): a 400
    naming ``param``, the request field at fault, where one is known."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextLengthError(InputError):
    """A prompt that, with what it asks to generate, does not fit the model's context: the
    server answers OpenAI's code ``context_length_exceeded`` (clients match on it to shorten
    a conversation), and ``/v1/responses`` with ``truncation: "auto"`` drops its oldest turns."""


class EngineStartError(RuntimeError):
    """An engine that ended before it was ready for reasons of its own process (killed by the
    OOM killer or an operator, crashed): the start fails, and the CLI says so in one line (exit
    1), as it does for a failed generation, with no traceback to read."""


class UnavailableError(Exception):
    """Something outside the daemon that a start needs is not there now but may be soon: a port
    another process still holds, an address not yet on an interface, a Ray cluster that does not
    answer or lacks the nodes. The start fails with one line, exit status 1, which a supervisor
    retries; exit status 2 means a setting to fix, which systemd does not retry
    (systemd/yaied.service: RestartPreventExitStatus=2). Raised as one of the two below, so that
    what catches OSError or ValueError (a 400 over HTTP) still does."""


class UnreachableError(UnavailableError, ValueError):
    """An UnavailableError that callers treat as a bad value (``POST /v1/engines``: a 400)."""


class ListenError(UnavailableError, OSError):
    """An UnavailableError of the listening socket: the port in use, the address not here."""
