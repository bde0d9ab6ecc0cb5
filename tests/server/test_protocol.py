"""Request parsing and response building, without a model."""

from __future__ import annotations

import pytest

from yaied.core.request import TokenLogprobs
from yaied.server.chat_protocol import parse_chat
from yaied.server.config import ServerConfig, load_server_config
from yaied.server.errors import APIError, from_value_error
from yaied.server.protocol import parse_completion, parse_prompts
from yaied.server.responses import CompletionLogprobs, chat_logprobs, usage_body
from yaied.server.token_text import TokenText, token_name


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
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"functions": [{}]}, "functions"),
        ({"response_format": {"type": "json_objects"}}, "response_format.type"),
    ]:
        with pytest.raises(APIError) as info:
            parse_chat({"messages": messages, **extra})
        assert info.value.param == param
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(APIError, match="only text parts"):
        parse_chat({"messages": image})


M = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize(
    "parse, body, param, words",
    [
        (parse_completion, {"prompt": "x", "frobnicate": 1}, "frobnicate", "Unrecognized"),
        (parse_completion, {"prompt": "x", "b": 1, "a": 2}, "a", "arguments supplied: a, b"),
        (parse_completion, {"prompt": "x", "store": True}, "store", "Unrecognized"),
        (parse_completion, {"prompt": "x", "add_generation_prompt": True}, None, "Unrecognized"),
        (parse_chat, {"messages": M, "guided_json": []}, "guided_json", "JSON object"),
        (parse_completion, {"prompt": "x", "guided_choice": []}, None, "non-empty list"),
        (
            parse_completion,
            {"prompt": "x", "response_format": {"type": "json_schema"}},
            "response_format.json_schema",
            "must be an object",
        ),
        (
            parse_completion,
            {"prompt": "x", "guided_regex": "a", "guided_choice": ["a"]},
            "guided_choice",
            "only one output constraint",
        ),
        (
            parse_chat,
            {"messages": M, "guided_json": {}, "guided_decoding_backend": "outlines"},
            "guided_decoding_backend",
            "xgrammar",
        ),
        (
            parse_chat,
            {"messages": M, "guided_json": {}, "guided_whitespace_pattern": " "},
            "guided_whitespace_pattern",
            "not supported",
        ),
        (parse_chat, {"messages": M, "reasoning_effort": "huge"}, "reasoning_effort", "one of"),
        (parse_chat, {"messages": M, "moderation": {}}, "moderation", "not supported"),
        (parse_chat, {"messages": M, "audio": {}}, "audio", "not supported"),
        (parse_chat, {"messages": M, "modalities": ["audio"]}, "modalities", "not supported"),
        (parse_chat, {"messages": M, "store": "yes"}, "store", "must be bool"),
        (parse_chat, {"messages": M, "metadata": []}, "metadata", "must be dict"),
        (
            parse_chat,
            {"messages": M, "stream": True, "stream_options": {"include_usages": True}},
            "stream_options.include_usages",
            "not supported",
        ),
        (
            parse_chat,
            {"messages": M, "chat_template_kwargs": {"add_generation_prompt": False}},
            "chat_template_kwargs.add_generation_prompt",
            "may not set",
        ),
        (parse_chat, {"messages": M, "chat_template_kwargs": {"a-b": 1}}, None, "identifiers"),
        (parse_chat, {"messages": M, "add_generation_prompt": "no"}, None, "must be bool"),
    ],
)
def test_unknown_and_unimplemented_fields_are_refused_by_name(parse, body, param, words):
    with pytest.raises(APIError) as info:
        parse(body)
    expected = param or next(k for k in body if k not in ("prompt", "messages"))
    assert info.value.status == 400 and info.value.param == expected
    assert words in info.value.message


def test_openai_fields_that_change_nothing_are_accepted():
    messages = [{"role": "user", "content": "hi"}]
    parsed = parse_chat(
        {
            "messages": messages,
            "store": True,
            "metadata": {"k": "v"},
            "service_tier": "default",
            "parallel_tool_calls": True,
            "prompt_cache_key": "x",
            "safety_identifier": "y",
            "modalities": ["text"],
            "response_format": {"type": "text"},
            "stream": True,
            "stream_options": {"include_usage": True, "include_obfuscation": False},
        }
    )
    assert parsed.include_usage and parsed.add_generation_prompt
    assert parsed.chat_template_kwargs == {}
    options = parse_chat(
        {
            "messages": messages,
            "add_generation_prompt": False,
            "chat_template_kwargs": {"enable_thinking": False},
        }
    )
    assert not options.add_generation_prompt
    assert options.chat_template_kwargs == {"enable_thinking": False}
    completion = parse_completion({"prompt": ["a", "b"], "response_format": {"type": "text"}})
    assert completion.prompts == ["a", "b"]


PREFILLED = [*M, {"role": "assistant", "content": '{"name": "'}]


def test_continue_final_message_turns_off_the_generation_prompt():
    parsed = parse_chat({"messages": PREFILLED, "continue_final_message": True})
    assert parsed.continue_final_message and not parsed.add_generation_prompt
    # vLLM's clients send both fields; the same meaning
    both = {"messages": PREFILLED, "continue_final_message": True, "add_generation_prompt": False}
    assert parse_chat(both).continue_final_message
    plain = parse_chat({"messages": PREFILLED})
    assert plain.add_generation_prompt and not plain.continue_final_message


@pytest.mark.parametrize(
    "extra, param, words",
    [
        ({"add_generation_prompt": True}, "add_generation_prompt", "add_generation_prompt false"),
        ({"response_format": {"type": "json_object"}}, None, "structured output"),
        ({"guided_choice": ["a", "b"]}, None, "structured output"),
        (
            {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
            None,
            "forced tool call",
        ),
        ({"continue_final_message": "yes"}, None, "must be bool"),
    ],
)
def test_a_continued_message_refuses_what_contradicts_it(extra, param, words):
    with pytest.raises(APIError) as info:
        parse_chat({"messages": PREFILLED, "continue_final_message": True, **extra})
    assert info.value.status == 400 and info.value.param == (param or "continue_final_message")
    assert words in info.value.message


def test_a_message_with_tool_calls_is_not_continued():
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [*M, {"role": "assistant", "content": "calling", "tool_calls": [call]}]
    with pytest.raises(APIError, match="carries tool calls"):
        parse_chat({"messages": messages, "continue_final_message": True})


def test_value_errors_name_their_parameter():
    assert from_value_error(ValueError("top_p must be in (0, 1], got 2")).param == "top_p"
    err = from_value_error(ValueError("max_tokens must be at least 1"), {"max_tokens": "x"})
    assert err.param == "x"
    assert from_value_error(ValueError("prompt (9 tokens) plus max_tokens")).param == "prompt"
    assert err.body()["error"]["type"] == "invalid_request_error"


def test_completion_logprobs_offsets_continue_across_takes():
    names = TokenText(None)  # no tokenizer: tokens are named token_id:N
    lp = CompletionLogprobs(names, names.output_offsets([1, 2], True, base=20))
    lp.add_prompt([1, 2], [None, TokenLogprobs(2, -1.0, [3], [-0.5])], [0, 10])
    first = lp.take()
    assert first["tokens"] == ["token_id:1", "token_id:2"]
    assert first["token_logprobs"] == [None, -1.0]
    assert first["top_logprobs"] == [None, {"token_id:3": -0.5, "token_id:2": -1.0}]
    assert first["text_offset"] == [0, 10]
    lp.add(4, TokenLogprobs(4, -2.0, [], []))
    lp.add(5, TokenLogprobs(5, -2.0, [], []))
    assert lp.take()["text_offset"] == [20, 30]


def test_chat_logprobs_and_usage():
    names = TokenText(None)
    out = chat_logprobs(names, [TokenLogprobs(1, -0.1, [1], [-0.1])])
    assert out["content"][0]["token"] == "token_id:1"
    assert out["content"][0]["bytes"] == list(b"token_id:1")
    assert out["content"][0]["top_logprobs"][0]["logprob"] == -0.1
    assert usage_body(3, 2, 1) == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 1},
    }


def test_token_names_escape_pieces_of_a_character():
    assert token_name(b" hi") == " hi"
    assert token_name("é".encode()) == "é"
    assert token_name(b"\xf0\x9f") == "bytes:\\xf0\\x9f"
    assert token_name(b" \xe2") == "bytes:\\x20\\xe2"


def sentencepiece_tokenizer():
    """A Llama-2-style SentencePiece tokenizer in memory: Unigram with byte fallback, Metaspace
    pre-tokenizer, the Replace/ByteFallback/Fuse/Strip decoder, a BOS added in front."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)]
    vocab += [(f"<0x{i:02X}>", -20.0) for i in range(256)]
    vocab += [("\u2581Hello", -1.0), ("\u2581world", -1.0), ("\u2581", -3.0), ("!", -2.0)]
    backend = Tokenizer(models.Unigram(vocab, 0, byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def test_sentencepiece_token_names_bytes_and_offsets_agree_with_the_text():
    tokenizer = sentencepiece_tokenizer()
    names = TokenText(tokenizer)
    prompt = "Hello world \u2014 Hello!"  # the dash is three byte-fallback tokens
    ids = tokenizer.encode(prompt)
    assert tokenizer.convert_ids_to_tokens(ids)[:3] == ["<s>", "\u2581Hello", "\u2581world"]
    # Echo: the prompt's own tokens, then generated ones, as a completions choice lists them.
    output = tokenizer.encode(" world \u2014!", add_special_tokens=False)
    text = prompt + tokenizer.decode(ids + output)[len(tokenizer.decode(ids)) :]
    lp = CompletionLogprobs(names, names.output_offsets(ids, True, base=len(prompt)))
    lp.add_prompt(ids, [None] * len(ids), names.prompt_offsets(ids, prompt))
    for token_id in output:
        lp.add(token_id, TokenLogprobs(token_id, -1.0, [], []))
    out = lp.take()
    assert out["tokens"][:6] == [
        "<s>",
        " Hello",
        " world",
        " ",
        "bytes:\\xe2",
        "bytes:\\x80",
    ]
    dash = text.index("\u2014")
    assert out["text_offset"][:8] == [0, 0, 5, 11, dash, dash, dash, dash + 1]
    assert out["text_offset"] == sorted(out["text_offset"])
    for token, offset in zip(out["tokens"][2:], out["text_offset"][2:], strict=True):
        if not token.startswith("bytes:"):
            assert text[offset:].startswith(token), (token, offset, text)
    # Every token's real bytes: together they are the text (the first token's space aside).
    joined = b"".join(names.token_bytes(i) for i in ids[1:] + output)
    assert joined == (" " + text).encode()
    chat = chat_logprobs(names, [TokenLogprobs(ids[4], -1.0, [ids[2]], [-2.0])])["content"][0]
    assert chat["bytes"] == [0xE2] and chat["token"] == "bytes:\\xe2"
    assert chat["top_logprobs"][0] == {"token": " world", "logprob": -2.0, "bytes": list(b" world")}


def test_a_token_id_prompt_is_echoed_as_its_offsets_count_it():
    tokenizer = sentencepiece_tokenizer()
    names = TokenText(tokenizer)
    ids = tokenizer.encode("Hello world!")
    text = names.decode_prompt(ids)
    assert text == "<s> Hello world!"
    assert names.prompt_offsets(ids, text) == [0, 3, 9, 15]


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
    # an empty host (a YAIED_SERVER_HOST= typo) would listen on every interface
    with pytest.raises(ValueError, match="server.host must not be empty"):
        load_server_config(env={"YAIED_SERVER_HOST": ""})


def test_shipped_toml_server_section_equals_the_defaults():
    from pathlib import Path

    shipped = Path(__file__).resolve().parents[2] / "config" / "yaied.toml"
    assert load_server_config(shipped, env={}) == ServerConfig()


def test_reasoning_effort_goes_to_the_chat_template():
    """As /v1/responses' reasoning.effort and vLLM's chat field: the template's
    ``reasoning_effort`` variable; chat_template_kwargs, the more specific, wins."""
    assert parse_chat({"messages": M, "reasoning_effort": "xhigh"}).chat_template_kwargs == {
        "reasoning_effort": "xhigh"
    }
    both = {"messages": M, "reasoning_effort": "low",
            "chat_template_kwargs": {"reasoning_effort": "high"}}  # fmt: skip
    assert parse_chat(both).chat_template_kwargs == {"reasoning_effort": "high"}


def test_a_prompt_past_the_context_has_openais_code():
    """Clients (LangChain, the Agents SDK) shorten a conversation on context_length_exceeded."""
    from yaied.core.errors import ContextLengthError

    error = from_value_error(ContextLengthError("prompt (9 tokens) plus max_tokens (9) exceeds"))
    assert (error.status, error.code, error.param) == (400, "context_length_exceeded", "prompt")
    assert from_value_error(ValueError("prompt is empty")).code is None
