"""Streaming split of a reasoning model's output into reasoning_content and content.

Qwen3 and the DeepSeek-R1 distills write `<think> ... </think>` before the answer. Some templates
put the opening `<think>` in the prompt (R1 distills; `prompt_opens_reasoning` tells), so the
output starts inside the reasoning and only `</think>` appears: `starts_in_reasoning=True`.

Rules (the same whatever the deltas' boundaries):

- Only one reasoning block, and only at the start of the message (after whitespace). A `<think>`
  later in the answer is answer text: a model discussing the tags must not lose its answer.
- Whitespace around the reasoning is trimmed, and the content after `</think>` starts at its first
  non-space character; that is what Qwen3's template strips when it renders the turn back.
- A message that never closes its reasoning (cut by max_tokens) is all reasoning, content None.
- Without `starts_in_reasoning`, a message that does not open with `<think>` is all content,
  byte for byte (Qwen3 with enable_thinking=False).

The content side feeds the tool-call parser: calls written inside the reasoning are thoughts.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from yaied.tools._scan import partial_suffix

THINK_START = "<think>"
THINK_END = "</think>"


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    """What one fed delta released; the reasoning part always precedes the content part."""

    reasoning: str = ""
    content: str = ""


@dataclass(frozen=True, slots=True)
class ReasoningResult:
    reasoning: str | None  # message.reasoning_content; None when there was none
    content: str | None


def prompt_opens_reasoning(prompt: str, start_tag: str = THINK_START) -> bool:
    """Whether the rendered prompt already opened the reasoning block (the template ended the
    generation prompt with `<think>`), so the output starts inside it."""
    return prompt.rstrip().endswith(start_tag)


class _State(enum.Enum):
    START = enum.auto()  # only whitespace so far: is there a <think>?
    REASONING = enum.auto()
    AFTER = enum.auto()  # just after </think>: whitespace is dropped
    CONTENT = enum.auto()  # everything else is content, no more tags


class ReasoningParser:
    """One per generated message. `feed` each delta, `finish` at the end, then `result`."""

    def __init__(
        self,
        *,
        starts_in_reasoning: bool = False,
        start_tag: str = THINK_START,
        end_tag: str = THINK_END,
    ) -> None:
        self._starts_in = starts_in_reasoning
        self._start_tag = start_tag
        self._end_tag = end_tag
        self._state = _State.START
        self._buf = ""  # received, not yet decided
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._finished = False

    def feed(self, delta: str) -> ReasoningDelta:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._buf += delta
        return self._run(final=False)

    def finish(self) -> ReasoningDelta:
        """End of stream: release what was held back."""
        if self._finished:
            return ReasoningDelta()
        self._finished = True
        return self._run(final=True)

    def result(self) -> ReasoningResult:
        return ReasoningResult("".join(self._reasoning) or None, "".join(self._content) or None)

    @property
    def in_reasoning(self) -> bool:
        """Whether the output is (still, or possibly) reasoning: a grammar on the answer must wait
        until this turns False."""
        if self._state is _State.START:
            return self._starts_in or self._start_tag.startswith(self._buf.lstrip())
        return self._state is _State.REASONING

    def _run(self, final: bool) -> ReasoningDelta:
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            if self._state is _State.START:
                if not self._step_start(final):
                    break
            elif self._state is _State.REASONING:
                if not self._step_reasoning(final, reasoning):
                    break
            elif self._state is _State.AFTER:
                body = self._buf.lstrip()
                self._buf = body
                if not body:
                    break
                self._state = _State.CONTENT
            else:
                content.append(self._buf)
                self._buf = ""
                break
        reasoning = [r for r in reasoning if r]
        self._reasoning += reasoning
        self._content += [c for c in content if c]
        return ReasoningDelta("".join(reasoning), "".join(content))

    def _step_start(self, final: bool) -> bool:
        body = self._buf.lstrip()
        if body.startswith(self._start_tag):
            self._buf = body[len(self._start_tag) :].lstrip()
            self._state = _State.REASONING
            return True
        if not final and self._start_tag.startswith(body):
            return False  # empty, or a prefix of <think>: wait
        if self._starts_in:
            self._buf = body
            self._state = _State.REASONING
        else:
            self._state = _State.CONTENT
        return True

    def _step_reasoning(self, final: bool, out: list[str]) -> bool:
        buf = self._buf
        if not any(self._reasoning) and not any(out):
            buf = buf.lstrip()  # reasoning starts at its first non-space character
        i = buf.find(self._end_tag)
        if i >= 0:
            out.append(buf[:i].rstrip())
            self._buf = buf[i + len(self._end_tag) :]
            self._state = _State.AFTER
            return True
        if final:
            out.append(buf.rstrip())
            self._buf = ""
            return False
        # Hold back a possible start of </think>, and trailing whitespace that may precede it.
        keep = partial_suffix(buf, (self._end_tag,))
        body = buf[: len(buf) - keep].rstrip()
        out.append(body)
        self._buf = buf[len(body) :]
        return False
