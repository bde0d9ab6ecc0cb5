"""Response bodies and stream chunks in OpenAI's shapes, and logprobs in both of its formats.

Completions use the legacy format (parallel lists: tokens, token_logprobs, top_logprobs as
{token: logprob} dicts, text_offset); chat uses ``logprobs.content``, one entry per token with its
UTF-8 bytes and a list of top alternatives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from yaied.request import TokenLogprobs

TokenText = Callable[[int], str]


def token_text_fn(tokenizer: Any) -> TokenText:
    """Each token's own text; without a tokenizer, vLLM's ``token_id:N`` convention."""
    if tokenizer is None:
        return lambda token_id: f"token_id:{token_id}"
    return lambda token_id: tokenizer.decode([token_id])


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
    take, with text offsets continuing across takes (streaming sends one slice per chunk)."""

    token_text: TokenText
    offset: int = 0  # characters of text before the next token
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def add(self, token_id: int, lp: TokenLogprobs | None, sampled: bool = True) -> None:
        text = self.token_text(token_id)
        self.tokens.append(text)
        self.text_offset.append(self.offset)
        self.offset += len(text)
        if lp is None:  # the first prompt token has no logprob: nothing precedes it
            self.token_logprobs.append(None)
            self.top_logprobs.append(None)
            return
        self.token_logprobs.append(lp.logprob)
        top = {self.token_text(t): v for t, v in zip(lp.top_ids, lp.top_logprobs, strict=True)}
        if sampled:  # OpenAI's dict holds the sampled token too, even outside the top N
            top.setdefault(text, lp.logprob)
        self.top_logprobs.append(top)

    def add_prompt(self, prompt_ids: list[int], scored: list[TokenLogprobs | None]) -> None:
        for token_id, lp in zip(prompt_ids, scored, strict=False):
            self.add(token_id, lp)

    def take(self) -> dict[str, Any]:
        out = {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        return out


def chat_logprobs(token_text: TokenText, lps: list[TokenLogprobs]) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

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
    text: str,
    logprobs: dict[str, Any] | None,
    finish_reason: str | None,
    stop_reason: str | int | None = None,
) -> dict[str, Any]:
    return {
        "index": index,
        "message": {"role": "assistant", "content": text},
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
