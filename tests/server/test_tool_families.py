"""Each tool-call family end to end on a tiny random-weight model that carries the family's kind
of chat template: the template is detected (hermes for Qwen-style, llama3_json for Llama-3-style),
renders the tools and the tool history itself, the grammar makes even random weights write the
family's native markup, and the server parses it back into tool_calls."""

from __future__ import annotations

import json
import shutil

import jsonschema
import pytest

from tests.conftest import TINY_CONFIGS, make_tiny_model
from tests.server.conftest import engine_loader, in_process_server
from yaied.core.grammar_spec import make_spec
from yaied.server.config import ServerConfig
from yaied.tools import get_format, parse_tool_calls
from yaied.tools.grammar import Tool, ToolChoice, output_structural_tag

# Written for these tests in the families' shapes (not copies of the models' own templates).
QWEN_STYLE = """
{%- if tools %}<|im_start|>system
# Tools
Call a function by writing <tool_call>{"name": ..., "arguments": ...}</tool_call>.
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{{ message.content }}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA3_STYLE = """
{%- if tools %}<|start_header_id|>system<|end_header_id|>

Answer with a JSON function call: {"name": function name, "parameters": its arguments}.
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|eot_id|>
{%- endif %}
{%- for message in messages %}<|start_header_id|>
{{- 'ipython' if message.role == 'tool' else message.role }}<|end_header_id|>

{% if message.tool_calls %}{% for call in message.tool_calls -%}
{"name": "{{ call.function.name }}", "parameters": {{ call.function.arguments | tojson }}}
{%- endfor %}{% else %}{{ message.content }}{% endif %}<|eot_id|>
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

FAMILIES = {
    "qwen2": ("qwen2", QWEN_STYLE, "hermes"),
    "llama3": ("llama3-scaled", LLAMA3_STYLE, "llama3_json"),
}
PARAMS = {
    "type": "object",
    "properties": {
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 3},
    },
    "required": ["unit", "days"],
}
TOOLS = [
    {"type": "function", "function": {"name": "forecast", "parameters": PARAMS}},
    {"type": "function", "function": {"name": "clock"}},
]
ASK = [{"role": "user", "content": "Weather?"}]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory, default_model_folder):
    """(client, format name, template) for a tiny model of the family with the default model's
    tokenizer (so the markup is real text) and the family's template."""
    config_name, template, fmt = FAMILIES[request.param]
    vocab = json.loads((default_model_folder / "config.json").read_text())["vocab_size"]
    folder = tmp_path_factory.mktemp(request.param)
    configs = {config_name: dict(TINY_CONFIGS[config_name], vocab_size=vocab, eos_token_id=2)}
    make_tiny_model(config_name, folder, configs=configs)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_folder / name, folder / name)
    (folder / "chat_template.jinja").write_text(template)
    loader = engine_loader(model=str(folder), max_model_len=0, threads=1, dtype="float32")
    with in_process_server(ServerConfig(served_model_name="tiny"), loader, "tiny") as client:
        yield client, fmt


def test_the_template_renders_tools_and_history_natively(family):
    client, fmt = family
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "forecast", "arguments": '{"unit": "c", "days": 2}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    body = {"messages": history, "tools": TOOLS, "add_generation_prompt": True}
    tokens = client.post("/tokenize", json=body).json()["tokens"]
    text = client.post("/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert '"name": "clock"' in text  # the template's own tool list, not the fallback's
    assert "# Tools\n\nYou may call" not in text
    # the arguments reached the template as an object (rendered by its tojson), not as text
    assert get_format(fmt).render_call("forecast", {"unit": "c", "days": 2}).strip() in text


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "forecast"}}]
)
def test_random_weights_write_native_calls_under_the_grammar(family, choice):
    client, fmt = family
    for seed in range(3):
        body = {
            "messages": ASK,
            "tools": TOOLS,
            "tool_choice": choice,
            "parallel_tool_calls": False,  # random weights would go on calling up to max_tokens
            "seed": seed,
            "temperature": 1.0,
            "max_tokens": 200,
        }
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        result = response.json()["choices"][0]
        assert result["finish_reason"] == "tool_calls", result
        assert result["message"]["content"] is None
        for call in result["message"]["tool_calls"]:
            arguments = json.loads(call["function"]["arguments"])
            if call["function"]["name"] == "forecast":
                jsonschema.validate(arguments, PARAMS)
            else:
                assert arguments == {} and choice == "required"


def test_the_raw_output_is_the_family_markup(family):
    """The same grammar on /v1/completions (as a remote engine is sent it): the text itself is
    the family's markup, and the family's parser reads it back."""
    client, fmt = family
    tools = [Tool("forecast", parameters=PARAMS)]
    tag = output_structural_tag(tool_format=fmt, tools=tools, choice=ToolChoice("required"))
    spec = make_spec("structural_tag", tag, "tools")
    body = {
        "prompt": "Weather?",
        "structured_outputs": {"structural_tag": json.loads(spec.source)},
        "max_tokens": 200,
        "seed": 7,
    }
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    text = response.json()["choices"][0]["text"]
    assert text.startswith(get_format(fmt).call_prefix("forecast"))
    parsed = parse_tool_calls(text, fmt, tool_names=["forecast"])
    assert parsed.content is None and parsed.tool_calls
    jsonschema.validate(json.loads(parsed.tool_calls[0].arguments_json), PARAMS)


@pytest.fixture(scope="module")
def reasoner(tmp_path_factory, default_model_folder):
    """A tiny Qwen3-shaped model served with --reasoning-parser qwen3. Its template opens the
    reasoning block in the prompt (as R1 distills' do), unless enable_thinking is false, when it
    closes it there (as Qwen3's does)."""
    vocab = json.loads((default_model_folder / "config.json").read_text())["vocab_size"]
    folder = tmp_path_factory.mktemp("qwen3")
    configs = {"qwen3": dict(TINY_CONFIGS["qwen3"], vocab_size=vocab, eos_token_id=2)}
    make_tiny_model("qwen3", folder, configs=configs)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_folder / name, folder / name)
    thinking = (
        "{% if add_generation_prompt %}{% if enable_thinking is defined and not enable_thinking %}"
        "<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}"
    )
    (folder / "chat_template.jinja").write_text(QWEN_STYLE + thinking)
    loader = engine_loader(model=str(folder), max_model_len=0, threads=1, dtype="float32")
    config = ServerConfig(served_model_name="tiny", reasoning_parser="qwen3")
    with in_process_server(config, loader, "tiny") as client:
        yield client


# Random weights never close a thought by themselves: a bias towards "</", "think" and ">" (the
# default tokenizer's pieces of </think>) and a high temperature, which makes those three about
# equally likely, make them write it soon.
CLOSE_THINKING = {"9617": 100, "17400": 100, "46": 100}


@pytest.mark.parametrize("seed", range(3))
def test_reasoning_goes_to_reasoning_content_and_the_grammar_follows_it(reasoner, seed):
    body = {
        "messages": ASK,
        "structured_outputs": {"choice": ["yes", "no"]},
        "logit_bias": CLOSE_THINKING,
        "temperature": 5.0,
        "max_tokens": 200,
        "seed": seed,
    }
    result = reasoner.post("/v1/chat/completions", json=body).json()["choices"][0]
    message = result["message"]
    assert result["finish_reason"] == "stop", result
    assert message["content"] in ("yes", "no")  # the constraint held after the thought
    assert message["reasoning"] == message["reasoning_content"]
    assert "</think>" not in (message["reasoning_content"] or "")
    with reasoner.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [json.loads(line)["choices"][0]["delta"] for line in lines]
    streamed = "".join(d.get("reasoning_content", "") for d in deltas)
    assert streamed == (message["reasoning_content"] or "")
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]


def test_enable_thinking_reaches_the_template(reasoner):
    def prompt(**kwargs):
        body = {"messages": ASK, "add_generation_prompt": True, **kwargs}
        tokens = reasoner.post("/tokenize", json=body).json()["tokens"]
        return reasoner.post("/detokenize", json={"tokens": tokens}).json()["prompt"]

    assert prompt(chat_template_kwargs={"enable_thinking": False}).endswith("</think>\n\n")
    assert prompt().endswith("<think>\n")
