"""`server.api_key_file` and `server.chat_template`: what they read, and the template at work."""

from __future__ import annotations

import httpx
import jinja2
import pytest

from tests.server.conftest import (
    MODEL,
    default_model_available,
    engine_loader,
    start_server,
    stop_server,
)
from yaied.core.model_info import ModelInfo
from yaied.engine.inputs import InputProcessor
from yaied.server.config import ServerConfig, load_server_config

TEMPLATE = "{% for m in messages %}<<{{ m.content }}>>{% endfor %}"


def test_api_key_file_merges_with_api_keys(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# the ops team\nk2\n\n  k3  \n# k4\nk1\n")
    config = load_server_config(env={}, overrides={"api_keys": ["k1"], "api_key_file": str(path)})
    assert config.api_keys == ("k1", "k2", "k3")  # in order, once each
    env = {"YAIED_SERVER_API_KEY_FILE": str(path)}
    assert load_server_config(env=env).api_keys == ("k2", "k3", "k1")


def test_an_unreadable_api_key_file_is_a_value_error_naming_it(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(ValueError, match="server.api_key_file .*nope"):
        ServerConfig(api_key_file=missing)
    with pytest.raises(ValueError, match="server.api_key_file"):
        ServerConfig(api_key_file=str(tmp_path))  # a directory


@pytest.mark.parametrize("text", ["", "\n\n", "# every key revoked\n"])
def test_an_api_key_file_without_a_key_is_refused(tmp_path, text):
    """It turned authentication off without a word: an operator who emptied the file to revoke
    every key (and reloaded) opened the daemon to everyone."""
    path = tmp_path / "keys"
    path.write_text(text)
    with pytest.raises(ValueError, match=r"server\.api_key_file .*keys' holds no key"):
        ServerConfig(api_key_file=str(path))
    with pytest.raises(ValueError, match="holds no key"):  # not even beside api_keys
        load_server_config(env={}, overrides={"api_keys": ["k1"], "api_key_file": str(path)})


def test_chat_template_is_a_file_or_the_text(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert ServerConfig(chat_template=str(path)).chat_template == TEMPLATE
    assert ServerConfig(chat_template=TEMPLATE).chat_template == TEMPLATE
    assert ServerConfig().chat_template == ""


def test_a_chat_template_path_that_is_no_file_is_refused(tmp_path):
    # Not a template: every chat prompt would be this path, verbatim.
    for value in (str(tmp_path / "chatml.jinja"), str(tmp_path), "templates/chatml.jinja"):
        with pytest.raises(ValueError, match="server.chat_template .*no such file"):
            ServerConfig(chat_template=value)


@pytest.mark.parametrize("text", ["", "\n", "You are a helpful assistant.\n"])
def test_a_chat_template_file_without_jinja_is_refused(tmp_path, text):
    """An empty file was the tokenizer's own template without a word (chat_template "" means
    that); a file of plain text became every chat prompt, whatever the messages."""
    path = tmp_path / "t.jinja"
    path.write_text(text)
    with pytest.raises(ValueError, match=r"server\.chat_template .*t\.jinja' holds no Jinja"):
        ServerConfig(chat_template=str(path))


@pytest.mark.parametrize("where", ["file", "text"])
def test_a_chat_template_that_does_not_parse_is_refused_at_start(tmp_path, where):
    # Accepted, it failed every chat request with a 400 blaming the client's messages.
    broken = "{% for m in messages %}{{ m.content }}"  # no endfor
    value = broken
    if where == "file":
        (tmp_path / "t.jinja").write_text(broken)
        value = str(tmp_path / "t.jinja")
    with pytest.raises(ValueError, match=r"server.chat_template .*: line 1: .*endfor"):
        ServerConfig(chat_template=value)


def test_chat_templates_may_use_what_transformers_renders_with():
    # loop controls and the {% generation %} tag of assistant masks, as transformers allows
    template = (
        "{% for m in messages %}{% if loop.index > 8 %}{% break %}{% endif %}"
        "{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    )
    assert ServerConfig(chat_template=template).chat_template == template


class StubTokenizer:
    def __init__(self, chat_template: str | None) -> None:
        self.chat_template = chat_template

    def apply_chat_template(self, messages, chat_template=None, **kwargs):
        template = jinja2.Environment().from_string(chat_template or self.chat_template)
        return template.render(messages=messages)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]


def chat_text(tokenizer: StubTokenizer, messages, chat_template: str = "") -> str:
    inputs = InputProcessor(None, None, ModelInfo(1024, 256))
    inputs.tokenizer = tokenizer
    return inputs.chat_prompt(messages, chat_template)[1]


def test_the_override_replaces_the_tokenizers_template():
    messages = [{"role": "user", "content": "hi"}]
    assert chat_text(StubTokenizer("own:{{ messages[0].content }}"), messages) == "own:hi"
    assert chat_text(StubTokenizer("own"), messages, TEMPLATE) == "<<hi>>"
    assert chat_text(StubTokenizer(None), messages, TEMPLATE) == "<<hi>>"
    with pytest.raises(ValueError) as info:  # no template at all: a 400 naming messages
        chat_text(StubTokenizer(None), messages)
    assert info.value.param == "messages"
    with pytest.raises(ValueError) as info:  # a template's own error is the client's 400
        chat_text(StubTokenizer(None), messages, "{{ raise_me( }}")
    assert info.value.param == "messages"


@pytest.mark.skipif(not default_model_available(), reason="needs the default model package")
def test_a_served_chat_template_shapes_the_prompt(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    server = start_server(ServerConfig(chat_template=str(path)), engine_loader(threads=1), MODEL)
    try:
        messages = [{"role": "user", "content": "hi"}, {"role": "user", "content": "there"}]
        r = httpx.post(server.url + "/tokenize", json={"messages": messages})
        assert r.status_code == 200, r.text
        tokens = r.json()["tokens"]
        r = httpx.post(server.url + "/detokenize", json={"tokens": tokens})
        assert r.json()["prompt"] == "<<hi>><<there>>"
        body = {"messages": messages, "max_tokens": 1, "temperature": 0}
        r = httpx.post(server.v1 + "/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(tokens)
    finally:
        stop_server(server)
