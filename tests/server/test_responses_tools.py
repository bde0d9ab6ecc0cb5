"""The tools of a Responses body (responses_tools.py) in the shapes Codex CLI 0.171 sends them:
function tools grouped in a ``namespace`` tool, a hosted ``web_search`` tool, and
``client_metadata`` beside them."""

from __future__ import annotations

import pytest

from yaied.server.errors import APIError
from yaied.server.responses_output import Turn
from yaied.server.responses_protocol import parse_responses

OBJECT = {"type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"]}
EXEC = {
    "type": "function",
    "name": "exec_command",
    "description": "Runs a command in a PTY.",
    "strict": False,
    "parameters": {"type": "object", "properties": {}},
}
AGENTS = {"type": "namespace", "name": "multi_agent_v1",
          "description": "Tools for spawning and managing sub-agents.",
          "tools": [{"type": "function", "name": "close_agent", "description": "Close an agent.",
                     "strict": False, "parameters": OBJECT}]}  # fmt: skip
SEARCH = {"type": "web_search", "external_web_access": False}
CODEX = {
    "model": "m", "input": "Say hi", "stream": True, "tools": [EXEC, AGENTS, SEARCH],
    "tool_choice": "auto", "parallel_tool_calls": True, "reasoning": {"summary": "auto"},
    "store": False, "include": ["reasoning.encrypted_content"], "prompt_cache_key": "01a2",
    "client_metadata": {"session_id": "01a2", "x-codex-window-id": "01a2:0"},
}  # fmt: skip


def test_codexs_tools_and_client_metadata_are_taken():
    """A namespace's tools are the model's functions, each named ``<namespace>.<name>``; the
    hosted web search, which yaied does not run, is never offered to the model."""
    req = parse_responses(CODEX)
    names = [tool.name for tool in req.parsed.tools.tools]
    assert names == ["exec_command", "multi_agent_v1.close_agent"]
    assert req.tools == CODEX["tools"]  # echoed as sent
    assert req.namespaced == {"multi_agent_v1.close_agent": ("multi_agent_v1", "close_agent")}


def test_a_namespaced_call_comes_back_and_goes_in_by_its_own_name_and_namespace():
    req = parse_responses({**CODEX, "input": [
        {"role": "user", "content": "close it"},
        {"type": "function_call", "call_id": "c1", "name": "close_agent",
         "namespace": "multi_agent_v1", "arguments": '{"id": "a"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "closed"},
    ]})  # fmt: skip
    call = req.new_messages[1]["tool_calls"][0]["function"]
    assert call["name"] == "multi_agent_v1.close_agent"
    assert req.input_items[1]["name"] == "close_agent"
    assert req.input_items[1]["namespace"] == "multi_agent_v1"
    turn = Turn(req, "resp_0123456789", "m")
    call = {"index": 0, "id": "call_1", "function": {"name": "multi_agent_v1.close_agent",
                                                      "arguments": '{"id": "a"}'}}  # fmt: skip
    turn.blocks.feed([{"tool_calls": [call]}])
    item = turn.item(turn.blocks.blocks[0])
    assert (item["type"], item["name"], item["namespace"]) == (
        "function_call",
        "close_agent",
        "multi_agent_v1",
    )


@pytest.mark.parametrize(
    "tools, param",
    [
        ([{"type": "namespace", "name": "ns", "tools": []}], "tools[0]"),
        ([{"type": "namespace", "name": "ns", "tools": [SEARCH]}], "tools[0].tools[0]"),
        ([{"type": "namespace", "name": "ns", "tools": [{**EXEC, "name": "a b"}]}],
         "tools[0].tools[0].name"),
        ([EXEC, {"type": "namespace", "name": "ns", "tools": [{**EXEC, "parameters": 3}]}],
         "tools[1].tools[0].parameters"),
        ([{"type": "file_search"}], "tools[0]"),
    ],
)  # fmt: skip
def test_bad_namespaces_and_tools_yaied_cannot_run_are_refused(tools, param):
    with pytest.raises(APIError) as caught:
        parse_responses({**CODEX, "tools": tools})
    assert caught.value.status == 400 and caught.value.param == param, caught.value.message


def test_web_search_cannot_be_forced():
    with pytest.raises(APIError) as caught:
        parse_responses({**CODEX, "tool_choice": {"type": "web_search"}})
    assert caught.value.param == "tool_choice"


@pytest.mark.parametrize("tools", [[], [SEARCH]])
def test_auto_with_no_tool_to_offer_is_no_tools(tools):
    """Codex's compaction turn sends ``tools: []`` with ``tool_choice: "auto"``, as OpenAI
    takes it: the model has no tool to call, not a 400 (``required`` still is one)."""
    req = parse_responses({**CODEX, "tools": tools, "tool_choice": "auto"})
    assert not req.parsed.tools.active and req.tool_choice == "auto"
    with pytest.raises(APIError) as caught:
        parse_responses({**CODEX, "tools": tools, "tool_choice": "required"})
    assert caught.value.param == "tool_choice"
