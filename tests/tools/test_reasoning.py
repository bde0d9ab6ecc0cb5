"""The reasoning splitter on synthetic outputs, cut at every boundary; and its chaining with the
tool-call parser, as the server will run them."""

from __future__ import annotations

import itertools

import pytest

from tests.tools.splitting import splits
from yaied.tools import (
    ContentDelta,
    ReasoningDelta,
    ReasoningParser,
    ReasoningResult,
    ToolCallParser,
    prompt_opens_reasoning,
)


def stream(pieces: list[str], starts_in_reasoning: bool = False) -> ReasoningResult:
    parser = ReasoningParser(starts_in_reasoning=starts_in_reasoning)
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    result = parser.result()
    assert "".join(d.reasoning for d in deltas) == (result.reasoning or "")
    assert "".join(d.content for d in deltas) == (result.content or "")
    return result


CASES = [
    pytest.param(
        "<think>\nThe user wants 2+2.\n\nThat is 4.\n</think>\n\nThe answer is 4.",
        False,
        ("The user wants 2+2.\n\nThat is 4.", "The answer is 4."),
        id="qwen3",
    ),
    pytest.param(
        "The user wants 2+2.\n</think>\n\nThe answer is 4.",
        True,
        ("The user wants 2+2.", "The answer is 4."),
        id="opened-in-the-prompt",
    ),
    pytest.param(
        "<think>\nHmm.\n</think>\n\nYes.", True, ("Hmm.", "Yes."), id="opened-twice-is-tolerated"
    ),
    pytest.param("<think>\n\n</think>\n\nHi there", False, (None, "Hi there"), id="empty"),
    pytest.param(
        "<think>\nStill thinking when cut", False, ("Still thinking when cut", None), id="cut"
    ),
    pytest.param(
        "Cut before the end </thi", True, ("Cut before the end </thi", None), id="cut-tag"
    ),
    pytest.param(
        "\n Plain answer; </think> and <think> are text here.\n",
        False,
        (None, "\n Plain answer; </think> and <think> are text here.\n"),
        id="no-reasoning-is-exact",
    ),
    pytest.param("<thin", False, (None, "<thin"), id="a-prefix-of-the-tag-is-text"),
    pytest.param(
        "<think>a < b </thinking> </think>Then <think>x</think>",
        False,
        ("a < b </thinking>", "Then <think>x</think>"),
        id="one-block-only",
    ),
]


@pytest.mark.parametrize("text, starts_in, expected", CASES)
def test_every_split(text, starts_in, expected):
    whole = stream([text], starts_in)
    assert (whole.reasoning, whole.content) == expected
    for pieces in splits(text):
        assert stream(pieces, starts_in) == whole, pieces


def test_text_is_released_as_soon_as_it_is_certain():
    parser = ReasoningParser()
    assert parser.feed("<th") == ReasoningDelta() and parser.in_reasoning
    assert parser.feed("ink>\nStep one.\n") == ReasoningDelta("Step one.")
    assert parser.feed("Step two.</th") == ReasoningDelta("\nStep two.")
    assert parser.in_reasoning
    assert parser.feed("ink>\n\n") == ReasoningDelta() and not parser.in_reasoning
    assert parser.feed("Answer") == ReasoningDelta(content="Answer")
    assert parser.finish() == ReasoningDelta()
    with pytest.raises(RuntimeError):
        parser.feed("more")


def test_in_reasoning_without_a_think_tag():
    parser = ReasoningParser()
    parser.feed("Hello")
    assert not parser.in_reasoning
    assert ReasoningParser(starts_in_reasoning=True).in_reasoning


def test_prompt_opens_reasoning():
    assert prompt_opens_reasoning("<｜User｜>hi<｜Assistant｜><think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")
    # Qwen3 with enable_thinking=False closes an empty block in the prompt.
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_chained_with_the_tool_parser_every_split():
    # A Qwen3 turn: calls written while thinking are thoughts; the one after </think> is a call.
    text = (
        "<think>\nI could write <tool_call> here, but first think.\n</think>\n\n"
        'Checking.\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
    )
    expected = None
    for pieces in splits(text):
        counter = itertools.count()
        reasoning = ReasoningParser()
        tools = ToolCallParser("hermes", id_factory=lambda c=counter: f"call_{next(c)}")
        thought, content = "", ""
        for delta in [*(reasoning.feed(p) for p in pieces), reasoning.finish()]:
            thought += delta.reasoning
            events = tools.feed(delta.content)
            content += "".join(e.text for e in events if isinstance(e, ContentDelta))
        content += "".join(e.text for e in tools.finish() if isinstance(e, ContentDelta))
        got = (thought, content, tools.result())
        expected = expected or got
        assert got == expected
    thought, content, message = expected
    assert thought == "I could write <tool_call> here, but first think."
    assert content == message.content == "Checking."
    assert [(c.name, c.arguments_json) for c in message.tool_calls] == [
        ("get_time", '{"tz": "UTC"}')
    ]
