"""Response bodies and stream chunks in OpenAI's shapes, and logprobs in both of its formats.

Completions use the legacy format (parallel lists: tokens, token_logprobs, top_logprobs as
{token: logprob} dicts, text_offset); chat uses ``logprobs.content``, one entry per token with its
UTF-8 bytes and a list of top alternatives. How tokens are named, their bytes and their offsets:
token_text.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from yaied.core.request import TokenLogprobs
from yaied.server.token_text import TokenText


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


@dataclass(slots=True)
class CompletionLogprobs:
    """The legacy format, built incrementally; ``take`` returns what was added since the last
    take (streaming sends one slice per chunk). ``offset_of`` gives each output token's text
    offset in turn (TokenText.output_offsets); echoed prompt tokens bring their own."""

    names: TokenText
    offset_of: Callable[[int], int]
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def add(self, token_id: int, lp: TokenLogprobs | None, offset: int | None = None) -> None:
        text = self.names.name(token_id)
        self.tokens.append(text)
        self.text_offset.append(self.offset_of(token_id) if offset is None else offset)
        if lp is None:  # the first prompt token has no logprob: nothing precedes it
            self.token_logprobs.append(None)
            self.top_logprobs.append(None)
            return
        self.token_logprobs.append(lp.logprob)
        top = {self.names.name(t): v for t, v in zip(lp.top_ids, lp.top_logprobs, strict=True)}
        top.setdefault(text, lp.logprob)  # OpenAI's dict holds the chosen token too
        self.top_logprobs.append(top)

    def add_prompt(
        self,
        prompt_ids: list[int],
        scored: list[TokenLogprobs | None],
        offsets: Sequence[int],
    ) -> None:
        for token_id, lp, offset in zip(prompt_ids, scored, offsets, strict=False):
            self.add(token_id, lp, offset)

    def take(self) -> dict[str, Any]:
        out = {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        return out


def chat_logprobs(names: TokenText, lps: list[TokenLogprobs]) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        data = names.token_bytes(token_id)
        return {"token": names.name(token_id), "logprob": logprob, "bytes": list(data)}

    content = []
    for lp in lps:
        item = entry(lp.token_id, lp.logprob)
        pairs = zip(lp.top_ids, lp.top_logprobs, strict=True)
        item["top_logprobs"] = [entry(t, v) for t, v in pairs]
        content.append(item)
    return {"content": content}


@dataclass(frozen=True, slots=True)
class ResponseHead:
    """What every body and chunk of one response shares."""

    id: str
    created: int
    model: str


def completion_choice(
    index: int,
    text: str,
    logprobs: dict[str, Any] | None,
    finish_reason: str | None,
    stop_reason: str | int | None = None,
) -> dict[str, Any]:
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }


def chat_message_choice(
    index: int,
    message: dict[str, Any],
    logprobs: dict[str, Any] | None,
    finish_reason: str | None,
    stop_reason: str | int | None = None,
) -> dict[str, Any]:
    """`message`: role, content, and tool_calls / reasoning_content (server/chat_output.py)."""
    return {
        "index": index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }


def chat_delta_choice(
    index: int,
    delta: dict[str, Any],
    logprobs: dict[str, Any] | None,
    finish_reason: str | None,
) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def response_body(
    head: ResponseHead, kind: str, choices: list[dict[str, Any]], usage: dict[str, Any] | None
) -> dict[str, Any]:
    """A whole body (``kind`` text_completion / chat.completion) or a chunk (…chunk)."""
    return {
        "id": head.id,
        "object": kind,
        "created": head.created,
        "model": head.model,
        "choices": choices,
        "usage": usage,
    }
