"""The embedded default model against transformers fp32 reading the same GGUF file itself (its own
gguf_file= loader), so a bug in our conversion cannot hide behind a shared one: the converted
weights, then greedy output."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import assert_greedy_equal, hf_greedy
from yaied import LLM, SamplingParams
from yaied.worker.model_files import (
    DEFAULT_MODEL_NAME,
    find_default_model_gguf,
    iter_safetensors_weights,
)

pytestmark = pytest.mark.slow  # the default model, and transformers over its GGUF file

NEW_TOKENS = 20
TEXTS = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type with an oil-based ink and a screw press. Within fifty years",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number, computed iteratively so that '
    'large inputs do not overflow the stack."""\n    a, b = 0, 1\n    for _ in range(n):\n',
    "Photosynthesis is the process by which green plants, algae and some bacteria convert light "
    "energy into chemical energy stored in sugars. The light-dependent reactions take place in the",
]


@pytest.fixture(scope="module")
def oracle():
    """transformers' own fp32 model, read from the GGUF file by its gguf_file= loader (about
    20 s: every test against it lives in this file, so it loads once)."""
    gguf = find_default_model_gguf()
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    )
    return model.eval()


def test_default_weights_equal_transformers_gguf_loader(oracle, default_model_folder: Path):
    """Our conversion (worker/gguf_convert.py) gives transformers' weights, bit for bit."""
    reference = {name: t.float() for name, t in oracle.state_dict().items()}
    converted = dict(iter_safetensors_weights(default_model_folder, show_progress=False))
    # Tied embeddings: transformers exposes lm_head.weight, the GGUF (and our folder) has none.
    assert "lm_head.weight" not in converted
    assert set(converted) == set(reference) - {"lm_head.weight"}
    for name, tensor in converted.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, reference[name]), name


@pytest.fixture(scope="module")
def llm():
    engine = LLM(
        DEFAULT_MODEL_NAME, dtype="float32", max_num_batched_tokens=64, show_progress=False
    )
    yield engine
    engine.close()


def test_default_model_matches_transformers(oracle, llm):
    chat = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Explain why the sky is blue."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    prompts = [llm.tokenizer.encode(text) for text in [*TEXTS, chat]]
    assert all(len(p) >= 32 for p in prompts)
    rng = random.Random(3)
    fillers = [
        [rng.randrange(llm.vocab_size) for _ in range(rng.randint(5, 90))] for _ in range(12)
    ]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    batched = llm.generate(prompts + fillers, params)  # 16 requests, chunked prefill
    for prompt, out in zip(prompts, batched, strict=False):
        alone = llm.generate([prompt], params)[0]
        assert alone.token_ids == out.token_ids
        assert_greedy_equal(oracle, prompt, out.token_ids, hf_greedy(oracle, prompt, NEW_TOKENS))
    assert llm.stats()["num_free_pages"] == llm.stats()["num_pages"]


def test_default_model_text_and_eos(llm):
    chat = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 2?"}], tokenize=False, add_generation_prompt=True
    )
    out = llm.generate([chat], SamplingParams(max_tokens=64, temperature=0.0))[0]
    assert out.finish_reason == "stop"  # stops on the model's EOS (<|im_end|>)
    assert "4" in out.text
    assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
