"""/tokenize, /detokenize and /tokenizer_info as a client that tokenizes through the server uses
them (lm-eval's remote tokenizer: special tokens and the chat template from /tokenizer_info,
encode with add_special_tokens false, decode)."""

from __future__ import annotations

import pytest
from tokenizers.processors import TemplateProcessing

from tests.server.conftest import engine_loader, in_process_server
from yaied.server.config import ServerConfig

BOS = "<|endoftext|>"  # id 0 in the default model's vocabulary, which adds no BOS itself


@pytest.fixture(scope="module")
def tiny_chat(tiny_chat_model):
    loader = engine_loader(model=str(tiny_chat_model), max_model_len=512, threads=1)
    with in_process_server(ServerConfig(served_model_name="tiny"), loader, "ignored") as client:
        # a tokenizer that adds a BOS, as Llama's do
        tokenizer = client.app.state.server.manager.tokenizer
        tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
            single=f"{BOS} $A", special_tokens=[(BOS, 0)]
        )
        yield client


def test_tokenize_honours_add_special_tokens(tiny_chat):
    with_bos = tiny_chat.post("/tokenize", json={"prompt": "hello world"}).json()["tokens"]
    plain = tiny_chat.post(
        "/tokenize", json={"prompt": "hello world", "add_special_tokens": False}
    ).json()["tokens"]
    assert with_bos[0] == 0 and with_bos[1:] == plain and 0 not in plain
    bad = tiny_chat.post("/tokenize", json={"prompt": "x", "add_special_tokens": "no"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "add_special_tokens"


def test_tokenizer_info_gives_what_a_remote_tokenizer_needs(tiny_chat):
    info = tiny_chat.get("/tokenizer_info")
    assert info.status_code == 200, info.text
    info = info.json()
    assert info["eos_token"] == "<|im_end|>" and info["model_max_length"] == 512
    assert "<|im_start|>" in info["chat_template"]
    # what lm-eval derives from it: the EOS id by encoding its text without special tokens
    body = {"prompt": info["eos_token"], "add_special_tokens": False}
    eos_ids = tiny_chat.post("/tokenize", json=body).json()["tokens"]
    assert eos_ids == [2]
    assert tiny_chat.post("/detokenize", json={"tokens": eos_ids}).json()["prompt"] == "<|im_end|>"
