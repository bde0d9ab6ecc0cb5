"""Turning a parsed request into engine calls without stalling the event loop.

Tokenizing 5,000 prompts, or echoing a long prompt's logprobs with text offsets, takes
seconds of CPU. Done on the event loop it would stall every other stream and ``/health`` with
it. ``prepare_jobs`` does all of a request's per-prompt work in one call, which the server runs
in its CPU thread when the request is large (``ServerState.off_loop``); what is left on the
loop is proportional to the tokens a client reads.
"""

from __future__ import annotations

from yaied.router.manager import EngineManager
from yaied.server.chat_output import ChatSettings
from yaied.server.limits import RequestLimits
from yaied.server.protocol import ParsedRequest
from yaied.server.serving import Job, build_jobs
from yaied.server.token_text import TokenText


def request_size(parsed: ParsedRequest) -> int:
    """Characters and token ids to tokenize or detokenize: what ``prepare_jobs`` costs."""
    size = sum(len(prompt) for prompt in parsed.prompts)
    return size + sum(len(message.get("content") or "") for message in parsed.messages)


def prepare_jobs(
    manager: EngineManager,
    parsed: ParsedRequest,
    base_id: str,
    chat_template: str,
    limits: RequestLimits,
    chat: ChatSettings | None = None,
) -> list[Job]:
    """``build_jobs``, then echo's prompt text offsets when logprobs are echoed (found once per
    prompt; its n choices share them)."""
    jobs = build_jobs(manager, parsed, base_id, chat_template, limits, chat)
    if parsed.kind == "completion" and parsed.echo and parsed.logprobs is not None:
        names = TokenText.of(manager.tokenizer)
        offsets: dict[int, list[int]] = {}
        for job in jobs:
            if job.prompt_index not in offsets:
                offsets[job.prompt_index] = names.prompt_offsets(job.prompt_ids, job.prompt_text)
            job.prompt_offsets = offsets[job.prompt_index]
    return jobs
