"""`scripts/stress_crowd.py`'s checks, on canned answers: a crowd run is only as good as what it
would notice (the run itself needs a daemon and minutes: see its docstring)."""

from __future__ import annotations

import importlib.util
import random
import sys

from tests.test_imports import ROOT

_spec = importlib.util.spec_from_file_location("stress_crowd", ROOT / "scripts" / "stress_crowd.py")
assert _spec is not None and _spec.loader is not None
crowd = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = crowd  # its dataclasses look their module up
_spec.loader.exec_module(crowd)


def chat_result(text: str, logprob: float = -0.5, finish: str = "stop") -> crowd.Result:
    result = crowd.Result(200)
    lp = {"content": [{"token": "a", "logprob": logprob, "top_logprobs": [
        {"token": "a", "logprob": logprob}, {"token": "b", "logprob": -3.0}]}]}  # fmt: skip
    crowd.absorb(result.choices, {"index": 0, "message": {"content": text}, "logprobs": lp,
                                  "finish_reason": finish}, chat=True)  # fmt: skip
    return result


def test_streamed_chunks_and_a_body_give_the_same_record():
    body = chat_result("hello there")
    streamed = crowd.Result(200)
    for i, piece in enumerate(["hel", "lo ", "there"]):
        item = {"index": 0, "delta": {"content": piece}}
        if i == 2:
            item["finish_reason"] = "stop"
            item["logprobs"] = {"content": [{"token": "a", "logprob": -0.5, "top_logprobs": [
                {"token": "a", "logprob": -0.5}, {"token": "b", "logprob": -3.0}]}]}  # fmt: skip
        crowd.absorb(streamed.choices, item, chat=True)
    assert crowd.compare(None, body, streamed, 0.0) == []


def test_compare_names_text_finish_and_logprob_differences():
    alone = chat_result("hello there")
    assert crowd.compare(None, alone, chat_result("hello where"), 0.0)
    assert crowd.compare(None, alone, chat_result("hello there", finish="length"), 0.0)
    moved = chat_result("hello there", logprob=-0.5001)
    assert crowd.compare(None, alone, moved, 0.0)
    assert crowd.compare(None, alone, moved, 1e-3) == []


def test_validate_catches_a_broken_schema_a_wrong_tool_and_a_stop_left_in():
    spec = crowd.Spec("j", "/v1/chat/completions", {}, kind="json")
    assert crowd.validate(spec, chat_result('{"name": "x", "age": 3}')) == []
    assert crowd.validate(spec, chat_result('{"name": "x"}'))
    assert crowd.validate(spec, chat_result('{"name": "x", "age": 3'))
    named = {"type": "function", "function": {"name": "get_time"}}
    spec = crowd.Spec("t", "/v1/chat/completions", {"tool_choice": named}, kind="tool")
    result = crowd.Result(200)
    call = {"index": 0, "function": {"name": "get_weather", "arguments": "{}"}}
    crowd.absorb(result.choices, {"index": 0, "delta": {"tool_calls": [call]},
                                  "finish_reason": "tool_calls"}, chat=True)  # fmt: skip
    assert crowd.validate(spec, result)
    spec = crowd.Spec("s", "/v1/chat/completions", {"stop": ["lo t"]})
    assert crowd.validate(spec, chat_result("hello there"))


def test_a_stop_string_is_cut_from_the_twins_text():
    spec = crowd.Spec("s", "/v1/chat/completions", {})
    assert crowd.derive_stop(spec, chat_result("The harbor lantern glows tonight."))
    assert spec.body["stop"][0] in "The harbor lantern glows tonight."
    assert not crowd.derive_stop(spec, chat_result("short"))


def test_the_mix_covers_every_kind():
    systems = [crowd.system_prompt(random.Random(0), 40)]
    specs = crowd.build_specs(random.Random(0), 20, systems, 2048)
    bodies = [s.body for s in specs]
    assert {s.kind for s in specs} >= {"plain", "json", "tool", "stop", "end"}
    assert any(b.get("n", 1) > 1 and "seed" in b for b in bodies)
    assert any("logit_bias" in b for b in bodies) and any(b.get("echo") for b in bodies)
    assert any("presence_penalty" in b for b in bodies)
