"""Incremental detokenizer: one token id in, the newly decided text out.

Two layers, each holding text back for its own reason:

1. The token window turns ids into text. Decoding only ``ids[i:]`` can differ from decoding
   everything (SentencePiece drops the first token's leading space; byte-level BPE splits characters
   across tokens), so it decodes a short window that starts with a few tokens whose text was already
   passed on ("context") and passes on only what lies after that text. Text that ends in U+FFFD may
   be half a UTF-8 character, so replacement characters at the end are held until a later token
   decides them. A push decodes at most ``2 * _MAX_PENDING`` tokens, whatever the output length.
2. The stop matcher holds back any tail of the text that could still begin a stop string, and cuts
   the output when one completes.

The text a stream yields is ``decode(prompt + output)`` minus ``decode(prompt)``: the output as it
reads after the prompt, never cleaned up with ``clean_up_tokenization_spaces`` (that rewrite spans
token boundaries, so a stream cannot apply it consistently). For byte-level BPE tokenizers (GPT-2,
Llama 3, Qwen, SmolLM) this is exactly ``decode(output_ids)``. An unfinished character at the very
end is released by ``flush`` as U+FFFD, as ``decode`` gives it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

# A Hugging Face tokenizer (transformers' PreTrainedTokenizerBase): core imports no model library.
Tokenizer = Any

REPLACEMENT_CHAR = "\ufffd"

# Prompt tokens decoded in front of the first output token: enough for leading-space rules and for a
# byte-fallback run that spans the prompt's end.
_PROMPT_CONTEXT_TOKENS = 6

# After this many consecutive tokens that each leave the text ending in U+FFFD (garbage output: runs
# of stray bytes) all but the last character are released and the window slides anyway, so a push
# decodes at most twice this many tokens (context plus pending). A UTF-8 character has at most 4
# bytes and every byte-level token at least one, so for byte-level BPE the release stays exact.
_MAX_PENDING = 8


class IncrementalDetokenizer:
    """Turns one request's output token ids into text deltas, honouring stop strings.

    ``push`` returns the text decided by this token (maybe ""), ``flush`` releases what is held when
    the request ends for another reason (length, EOS, abort). After a stop string matched,
    ``stop_reason`` holds it and the output ends just before it (or just after it with
    ``include_stop_str_in_output``). Of several stop strings, the one whose occurrence completes
    first wins (ties: the longer one): that is where a generator that stops as soon as a stop
    string appears would stop, however the text is split into tokens.
    """

    __slots__ = (
        "_decode",
        "_skip_ids",
        "_ids",
        "_read",
        "_passed",
        "_stops",
        "_chunks",
        "_finished",
        "_num_pushed",
        "_min_tokens",
        "stop_reason",
    )

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self._decode = _decoder(tokenizer, skip_special_tokens)
        # Ids that decode() drops anyway: skipping them here saves a decode per EOS token.
        self._skip_ids = _special_ids(tokenizer) if skip_special_tokens else frozenset()
        # Window map, ids older than the window are forgotten:
        #   self._ids = [ context ......... | pending ............ ]
        #                0                  self._read             len
        # self._passed = how many characters of decode(self._ids) went to the stop matcher: all of
        # the context's text, plus the decided head of the pending text.
        prompt = [i for i in prompt_token_ids if i not in self._skip_ids]
        self._ids = prompt[-_PROMPT_CONTEXT_TOKENS:]
        context_text = self._decode(self._ids) if self._ids else ""
        if context_text.endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character (or in garbage): output bytes must not complete
            # it, or the output would start with a character that is partly the prompt's.
            self._ids = []
            context_text = ""
        self._read = len(self._ids)
        self._passed = len(context_text)
        self._stops = _StopMatcher(stop, include_stop_str_in_output)
        self._chunks: list[str] = []
        self._finished = False
        # Stop strings count only once min_tokens tokens are out (as the sampler bans EOS and
        # stop ids until then); text before that is passed on unmatched, as vLLM does.
        self._num_pushed = 0
        self._min_tokens = min_tokens
        self.stop_reason: str | None = None

    @property
    def output_text(self) -> str:
        """Everything emitted so far (the concatenation of all push and flush results)."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    @property
    def finished(self) -> bool:
        """True after a stop string matched or after flush; push then raises."""
        return self._finished

    def push(self, token_id: int) -> str:
        """Adds one output token and returns the text it decided (maybe "")."""
        if self._finished:
            raise RuntimeError(
                f"push after the detokenizer finished (stop string {self.stop_reason!r})"
                if self.stop_reason is not None
                else "push after the detokenizer was flushed"
            )
        self._num_pushed += 1
        if token_id in self._skip_ids:
            return ""
        self._ids.append(token_id)
        return self._emit(self._decided_text(), final=False)

    def flush(self) -> str:
        """Releases all held text; the request is over. Idempotent; "" after a stop."""
        if self._finished:
            return ""
        # Decodes even with nothing pending: a forced slide leaves its last character undecided.
        text = self._decode(self._ids) if self._ids else ""
        return self._emit(text[self._passed :], final=True)

    def _decided_text(self) -> str:
        # One decode of the window per push; a second one when the window slides behind context.
        text = self._decode(self._ids)
        if not text.endswith(REPLACEMENT_CHAR):
            decided = text[self._passed :]
            self._slide(text, keep_last_char=False)
        elif len(self._ids) - self._read >= _MAX_PENDING:
            # Garbage run: the last character may still complete, everything before it is final.
            decided = text[self._passed : len(text) - 1]
            self._slide(text, keep_last_char=True)
        else:
            end = len(text.rstrip(REPLACEMENT_CHAR))
            decided = text[self._passed : end]
            self._passed = max(self._passed, end)
        return decided

    def _slide(self, text: str, *, keep_last_char: bool) -> None:
        """Makes the pending tokens the new context: their text has been passed on."""
        if self._read:
            del self._ids[: self._read]
            # Re-decoded alone, the new context may read differently (a dropped leading space),
            # so _passed is measured on that text, not on the old window's.
            text = self._decode(self._ids)
        self._read = len(self._ids)
        undecided = 1 if keep_last_char and text.endswith(REPLACEMENT_CHAR) else 0
        self._passed = len(text) - undecided

    def _emit(self, decided: str, *, final: bool) -> str:
        if self._num_pushed < self._min_tokens:
            delta = decided  # too early for stop strings: nothing to hold back or match
        else:
            delta, self.stop_reason = self._stops.feed(decided, final=final)
        if self.stop_reason is not None or final:
            self._finished = True
            self._ids = []
        if delta:
            self._chunks.append(delta)
        return delta


class _StopMatcher:
    """Holds back any tail of the text that could begin a stop string; cuts at a complete one.

    One Knuth-Morris-Pratt automaton per stop string, fed each new character once: its state is
    how much of the stop string the text so far ends with. A push costs O(new characters x stop
    strings) amortised and never more than O(total stop length), however the text is split, so
    long stop strings cannot make the per-token check quadratic on the engine's loop.
    """

    __slots__ = ("_stops", "_fail", "_state", "_include", "_held")

    def __init__(self, stops: Sequence[str], include: bool) -> None:
        # An empty stop string would match before any text; it is ignored rather than honoured.
        self._stops = tuple(s for s in dict.fromkeys(stops) if s)
        self._fail = [_failure_function(s) for s in self._stops]
        self._state = [0] * len(self._stops)
        self._include = include
        self._held = ""

    def feed(self, text: str, *, final: bool) -> tuple[str, str | None]:
        """Returns (text that is safe to emit, the stop string that matched or None)."""
        if not self._stops:
            return text, None
        buf = self._held + text
        offset = len(self._held)
        for i, char in enumerate(text):
            # Of the stop strings completing at this character, the longest wins (it started
            # first); the first character where any completes decides.
            stop = None
            for k, s in enumerate(self._stops):
                state, fail = self._state[k], self._fail[k]
                while state and s[state] != char:
                    state = fail[state - 1]
                if s[state] == char:
                    state += 1
                if state == len(s):
                    if stop is None or len(s) > len(stop):
                        stop = s
                    state = fail[state - 1]
                self._state[k] = state
            if stop is not None:
                end = offset + i + 1
                self._held = ""
                return buf[: end if self._include else end - len(stop)], stop
        # Emitted text never ends in a stop string's prefix, so every state fits inside buf.
        keep = 0 if final else max(self._state)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], None


def _failure_function(pattern: str) -> list[int]:
    """KMP's table: fail[i] = the longest proper prefix of pattern[: i + 1] that is also its
    suffix."""
    fail = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = fail[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        fail[i] = k
    return fail


def _decoder(tokenizer: Tokenizer, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    # The Rust tokenizer's decode skips the Python wrapper (about 2x faster per call) and never
    # applies clean_up_tokenization_spaces.
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return functools.partial(backend.decode, skip_special_tokens=skip_special_tokens)
    return functools.partial(
        tokenizer.decode,
        skip_special_tokens=skip_special_tokens,
        clean_up_tokenization_spaces=False,
    )


def _special_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """The ids decode(skip_special_tokens=True) drops: every added token flagged special."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids = {i for i, token in added.items() if getattr(token, "special", False)}
    ids.update(tokenizer.all_special_ids)
    return frozenset(ids)
