"""Request parsing and response building, without a model."""

from __future__ import annotations

import pytest

from yaied.request import TokenLogprobs
from yaied.server.config import ServerConfig, load_server_config
from yaied.server.errors import APIError, from_value_error
from yaied.server.protocol import parse_chat, parse_completion, parse_prompts
from yaied.server.responses import CompletionLogprobs, chat_logprobs, usage_body


@pytest.mark.parametrize(
    "prompt, expected",
    [
        ("hi", ["hi"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_prompt_shapes(prompt, expected):
    assert parse_prompts(prompt) == expected


@pytest.mark.parametrize("prompt", [None, [], [1, "a"], [[1], []], 3, [True], {"a": 1}])
def test_bad_prompts_name_the_field(prompt):
    with pytest.raises(APIError) as info:
        parse_prompts(prompt)
    assert info.value.status == 400 and info.value.param == "prompt"


def test_completion_fields_become_sampling_keywords():
    parsed = parse_completion(
        {"prompt": "x", "max_tokens": 3, "temperature": 0, "stop": "\n", "top_k": 5, "seed": 7}
    )
    assert parsed.max_tokens == 3
    assert parsed.sampling == {"temperature": 0, "stop": ["\n"], "top_k": 5, "seed": 7}
    assert parse_completion({"prompt": "x"}).max_tokens == 16


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x", "max_tokens": "3"}, "max_tokens"),
        ({"prompt": "x", "temperature": True}, "temperature"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "stop": [1]}, "stop"),
        ({"prompt": "x", "suffix": "s"}, "suffix"),
        ({"prompt": "x", "best_of": 2}, "best_of"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_completion_rejections(body, param):
    with pytest.raises(APIError) as info:
        parse_completion(body)
    assert (info.value.status, info.value.param) == (400, param)


def test_chat_content_parts_and_unimplemented_fields():
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    parsed = parse_chat({"messages": messages, "logprobs": True, "top_logprobs": 2})
    assert parsed.messages == [{"role": "user", "content": "a\nb"}]
    assert parsed.logprobs == 2 and parsed.max_tokens is None
    assert parse_chat({"messages": messages, "max_completion_tokens": 4}).max_tokens == 4
    assert parse_chat({"messages": messages, "response_format": {"type": "text"}}).n == 1
    for extra, param in [
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"functions": [{}]}, "functions"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ]:
        with pytest.raises(APIError) as info:
            parse_chat({"messages": messages, **extra})
        assert info.value.param == param
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(APIError, match="only text parts"):
        parse_chat({"messages": image})


def test_unknown_fields_are_ignored_with_a_warning(caplog):
    parse_completion({"prompt": "x", "frobnicate": 1})
    assert "frobnicate" in caplog.text


def test_value_errors_name_their_parameter():
    assert from_value_error(ValueError("top_p must be in (0, 1], got 2")).param == "top_p"
    err = from_value_error(ValueError("max_tokens must be at least 1"), {"max_tokens": "x"})
    assert err.param == "x"
    assert from_value_error(ValueError("prompt (9 tokens) plus max_tokens")).param == "prompt"
    assert err.body()["error"]["type"] == "invalid_request_error"


def test_completion_logprobs_offsets_continue_across_takes():
    lp = CompletionLogprobs(lambda t: f"<{t}>")
    lp.add_prompt([1, 2], [None, TokenLogprobs(2, -1.0, [3], [-0.5])])
    first = lp.take()
    assert first["tokens"] == ["<1>", "<2>"] and first["token_logprobs"] == [None, -1.0]
    assert first["top_logprobs"] == [None, {"<3>": -0.5, "<2>": -1.0}]
    assert first["text_offset"] == [0, 3]
    lp.add(4, TokenLogprobs(4, -2.0, [], []))
    assert lp.take()["text_offset"] == [6]


def test_chat_logprobs_and_usage():
    out = chat_logprobs(lambda t: "é", [TokenLogprobs(1, -0.1, [1], [-0.1])])
    assert out["content"][0]["bytes"] == [195, 169]
    assert out["content"][0]["top_logprobs"][0]["logprob"] == -0.1
    assert usage_body(3, 2, 1) == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 1},
    }


def test_server_config_layers(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[server]\nport = 9000\napi_keys = ["a"]\n[cache]\npage_size = 8\n')
    config = load_server_config(path, env={"YAIED_SERVER_API_KEYS": "k1, k2"})
    assert config.port == 9000 and config.api_keys == ("k1", "k2")
    assert load_server_config(env={}, overrides={"port": 1}).port == 1
    with pytest.raises(ValueError, match="server.port must be a int"):
        load_server_config(env={}, overrides={"port": "x"})
    with pytest.raises(ValueError, match="unknown"):
        load_server_config(env={}, overrides={"prot": 1})


def test_shipped_toml_server_section_equals_the_defaults():
    from pathlib import Path

    shipped = Path(__file__).resolve().parents[2] / "config" / "yaied.toml"
    assert load_server_config(shipped, env={}) == ServerConfig()
