"""The `[server]` section of config/yaied.toml: where the daemon listens and what it accepts.

yaied/core/config.py owns the engine's sections and skips this one; the same precedence
applies here: defaults < TOML < ``YAIED_SERVER_<KEY>`` < explicit overrides.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from yaied.core.config import load_section, read_toml
from yaied.server.keys import KeyTable
from yaied.tools import FORMATS

# The names --tool-call-parser and --reasoning-parser take: the tool-call formats
# (yaied/tools/formats.py), and the reasoning families, which all write <think> ... </think>.
TOOL_CALL_PARSERS = tuple(FORMATS)
REASONING_PARSERS = ("deepseek_r1", "qwen3")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"  # listen address; 0.0.0.0 for every interface
    port: int = 8000  # listen port
    served_model_name: str = ""  # the name in /v1/models and requests; "" = model.model
    # Accepted `Authorization: Bearer` keys, each "<secret> [name=..] [admin=..]
    # [may_set_priority=..] [max_in_flight=..]" (README, "API keys"); empty = no auth.
    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = 8 * 1024 * 1024  # larger request bodies get 413
    max_queue_len: int = 1024  # waiting requests beyond this get 429; 0 = unlimited
    sse_ping_seconds: float = 15.0  # keep-alive comment interval on idle streams
    retry_after_seconds: int = 1  # the Retry-After of a 429
    drain_timeout_seconds: float = 30.0  # on SIGTERM: how long in-flight requests may finish
    # On SIGTERM: the whole stop (drain, aborts, engines) ends within this (server/shutdown.py);
    # 10 s under systemd's TimeoutStopSec (60) for the process's own exit.
    stop_timeout_seconds: float = 50.0
    api_key_file: str = ""  # more keys, one a line (blank lines and # comments skipped)
    chat_template: str = ""  # a Jinja chat template (file or text) over the tokenizer's own
    max_prompt_tokens: int = 0  # longer prompts get 400; 0 = the model's context length
    max_tokens_limit: int = 0  # max_tokens above this get 400 (chat's default is capped); 0 = none
    max_n: int = 128  # choices per prompt (`n`) above this get 400
    max_jobs_per_request: int = 256  # prompts x n above this get 400 (each is one engine call)
    body_timeout_seconds: float = 30.0  # a request body not read in full by then gets 408
    send_timeout_seconds: float = 30.0  # a client taking no bytes this long is disconnected
    limit_concurrency: int = 1024  # connections + tasks at once; past it, uvicorn answers 503
    cors_allow_origins: tuple[str, ...] = ()  # cross-site origins ("*" = any); empty = no CORS
    # Tool calls: the model family's markup (hermes, llama3_json); "" = from the chat template.
    tool_call_parser: str = ""
    # <think> blocks to reasoning_content (deepseek_r1, qwen3); "" = none, all is content.
    reasoning_parser: str = ""
    # /v1/responses with store: responses kept for previous_response_id and GET, least recently
    # used dropped first, per server (each API key sees only its own).
    responses_store_max: int = 10_000  # stored responses at most
    responses_store_max_bytes: int = 256 * 1024 * 1024  # their conversations' bytes at most

    def __post_init__(self) -> None:
        # Both files are read once, here; a replace() rereads them and changes nothing.
        keys = tuple(self.api_keys) + read_api_key_file(self.api_key_file)
        object.__setattr__(self, "api_keys", tuple(dict.fromkeys(keys)))
        object.__setattr__(self, "chat_template", read_chat_template(self.chat_template))
        if not all(isinstance(k, str) and k for k in self.api_keys):
            raise ValueError("server.api_keys must be non-empty strings")
        KeyTable.parse(self.api_keys)  # a bad entry fails at start-up, naming it
        if not self.host.strip():  # uvicorn would listen on every interface
            raise ValueError("server.host must not be empty (0.0.0.0 listens on every interface)")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"server.port must be in [0, 65535], got {self.port}")
        names = ("max_body_bytes", "retry_after_seconds", "max_n", "max_jobs_per_request")
        for name in (*names, "limit_concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"server.{name} must be >= 1, got {getattr(self, name)}")
        limits = ("max_queue_len", "max_prompt_tokens", "max_tokens_limit")
        for name in (*limits, "responses_store_max", "responses_store_max_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"server.{name} must be >= 0, got {getattr(self, name)}")
        if not all(isinstance(o, str) and o for o in self.cors_allow_origins):
            raise ValueError("server.cors_allow_origins must be non-empty strings")
        if not self.drain_timeout_seconds >= 0:
            raise ValueError("server.drain_timeout_seconds must be >= 0")
        if self.tool_call_parser and self.tool_call_parser not in TOOL_CALL_PARSERS:
            known = ", ".join(TOOL_CALL_PARSERS)
            raise ValueError(f"server.tool_call_parser must be one of {known}")
        if self.reasoning_parser and self.reasoning_parser not in REASONING_PARSERS:
            known = ", ".join(REASONING_PARSERS)
            raise ValueError(f"server.reasoning_parser must be one of {known}")
        if not self.stop_timeout_seconds > 0:
            raise ValueError("server.stop_timeout_seconds must be > 0")
        for name in ("body_timeout_seconds", "send_timeout_seconds"):
            if not getattr(self, name) > 0:
                raise ValueError(f"server.{name} must be > 0, got {getattr(self, name)}")
        if not self.sse_ping_seconds > 0:
            raise ValueError(f"server.sse_ping_seconds must be > 0, got {self.sse_ping_seconds}")


def read_api_key_file(path: str) -> tuple[str, ...]:
    """The key entries in ``path``, one a line (server/keys.py reads them); "" reads nothing.
    ValueError names an unreadable file, or one that holds no key (a reload that emptied it to
    revoke every key would otherwise have opened the daemon to all)."""
    if not path:
        return ()
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or exc
        raise ValueError(f"server.api_key_file {path!r}: {reason}") from None
    lines = (line.strip() for line in text.splitlines())
    keys = tuple(line for line in lines if line and not line.startswith("#"))
    if not keys:  # with no other key that would turn authentication off, saying nothing
        raise ValueError(
            f"server.api_key_file {path!r} holds no key; the daemon would let every request in "
            "(to run without keys, leave api_key_file unset)"
        )
    return keys


def read_chat_template(value: str) -> str:
    """The template text: the file's contents when ``value`` names a file, else ``value``, which
    must then look like a Jinja template (a mistyped path would otherwise become every chat
    prompt, verbatim). A template that does not parse is refused here, at start-up, instead of
    failing every chat request with a 400 that blames the request's messages."""
    if not value:
        return value
    if os.path.isfile(value):
        try:
            text = Path(value).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = getattr(exc, "strerror", None) or exc
            raise ValueError(f"server.chat_template {value!r}: {reason}") from None
        if "{{" not in text and "{%" not in text:  # empty: the tokenizer's template, silently
            raise ValueError(
                f"server.chat_template {value!r} holds no Jinja template (no {{{{ }}}} or "
                "{% %}): every chat prompt would be its text, whatever the messages"
            )
        where = repr(value)
    elif "{{" in value or "{%" in value:
        text, where = value, "(the text given)"
    else:
        raise ValueError(
            f"server.chat_template {value!r}: no such file, and no Jinja template either"
        )
    check_template_syntax(text, f"server.chat_template {where}")
    return text


def check_template_syntax(text: str, name: str) -> None:
    """ValueError, naming the line, when ``text`` is not a template transformers can compile
    (its own environment: loop controls, the ``{% generation %}`` tag). Skipped if that
    helper, not a public one, has moved: the request path still reports the error."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        return
    from jinja2 import TemplateSyntaxError

    try:
        _compile_jinja_template(text)
    except TemplateSyntaxError as exc:
        message = " ".join(str(exc.message).split())
        raise ValueError(f"{name}: line {exc.lineno}: {message}") from None


def load_server_config(
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> ServerConfig:
    """Read `[server]` from the TOML file, then ``YAIED_SERVER_*``, then ``overrides``."""
    return load_section(ServerConfig, "server", read_toml(path), env, overrides)
