"""What the agent CLIs people point at a local server send, replayed (trimmed from captures of
Claude Code 2.1.197 and Codex CLI 0.171.0 run against yaied) on a tiny random model in process:
every request is answered, and a stream in the events the CLI reads. What the model says does
not matter here; the protocol does."""

from __future__ import annotations

import orjson
import pytest

from tests.server.conftest import engine_loader, in_process_server
from yaied.server.config import ServerConfig

BASH_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "properties": {
        "command": {"description": "The command to execute", "type": "string"},
        "timeout": {"description": "Optional timeout in milliseconds", "type": "number"},
        "run_in_background": {"type": "boolean"},
    },
    "required": ["command"],
    "additionalProperties": False,
}
EPHEMERAL = {"type": "ephemeral"}
REMINDER = "<system-reminder>\nToday's date is 2026-11-29.\n</system-reminder>\n\n"
# Claude Code `-p "List the files here." --output-format stream-json` with its tools cut to one
CLAUDE_CODE = {
    "model": "tiny",
    "messages": [
        {"role": "user", "content": [
            {"type": "text", "text": REMINDER},
            {"type": "text", "text": "List the files here.", "cache_control": EPHEMERAL},
        ]},
        {"role": "system", "content": "Available agent types for the Agent tool:\n- Explore: ..."},
    ],
    "system": [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197.8a5;"},
        {"type": "text", "text": "You are a Claude agent.", "cache_control": EPHEMERAL},
    ],
    "tools": [{"name": "Bash", "description": "Runs a command.", "input_schema": BASH_SCHEMA}],
    "metadata": {"user_id": '{"device_id":"5894","account_uuid":"","session_id":"7ae75d9d"}'},
    "max_tokens": 32000,
    "thinking": {"type": "adaptive"},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    "output_config": {"effort": "high"},
    "stream": True,
}  # fmt: skip
CLAUDE_HEADERS = {
    "anthropic-beta": "claude-code-20250219,context-management-2025-06-27,"
    "mid-conversation-system-2026-04-07,effort-2025-11-24",
    "anthropic-version": "2023-06-01",
    "anthropic-dangerous-direct-browser-access": "true",
    "x-api-key": "sk-local-unused",
    "x-app": "cli",
    "X-Claude-Code-Session-Id": "7ae75d9d-2890-4492-a461-2eb48f65131c",
}


@pytest.fixture(scope="module")
def tiny_chat(tiny_chat_model):
    loader = engine_loader(model=str(tiny_chat_model), max_model_len=512, threads=1)
    with in_process_server(ServerConfig(served_model_name="tiny"), loader, "ignored") as client:
        yield client


def _sse(response) -> list[tuple[str, dict]]:
    """(event name, data) of each event; comments (pings) skipped."""
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            events.append((name, orjson.loads(line[6:])))
    return events


def test_claude_codes_turn_with_its_mid_conversation_system_message(tiny_chat):
    url = "/v1/messages?beta=true"
    with tiny_chat.stream("POST", url, json=CLAUDE_CODE, headers=CLAUDE_HEADERS) as response:
        assert response.status_code == 200, response.read()
        events = _sse(response)
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert all(name == data["type"] for name, data in events)
    stop = events[-2][1]["delta"]["stop_reason"]
    assert stop in ("end_turn", "tool_use", "model_context_window_exceeded")
    counted = tiny_chat.post(
        "/v1/messages/count_tokens?beta=true", headers=CLAUDE_HEADERS,
        json={k: CLAUDE_CODE[k] for k in ("model", "messages", "system", "tools")},
    )  # fmt: skip
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 0


def _codex_tool(name: str) -> dict:
    return {"type": "function", "name": name, "description": f"{name} a sub-agent.",
            "strict": False, "parameters": {"type": "object", "properties": {
                "target": {"type": "string"}}, "required": ["target"],
                "additionalProperties": False}}  # fmt: skip


def _codex_message(role: str, text: str) -> dict:
    return {"type": "message", "id": "msg_01a226e6-daed-70d1-a84b-6ad4094dc334", "role": role,
            "content": [{"type": "input_text", "text": text}]}  # fmt: skip


# Codex `exec --json "Say hi"` (model_instructions_file set: its own instructions do not fit
# the default model's context), its tools cut to one of each kind
CODEX = {
    "model": "tiny",
    "stream": True,
    "input": [
        _codex_message("developer", "You are Codex, a coding agent in a terminal."),
        _codex_message("user", "<environment_context>\n  <cwd>/w</cwd>\n</environment_context>"),
        _codex_message("user", "Say hi"),
    ],
    "tools": [
        {**_codex_tool("exec_command"), "description": "Runs a command in a PTY."},
        {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.",
         "tools": [_codex_tool("close_agent"), _codex_tool("spawn_agent")]},
        {"type": "web_search", "external_web_access": False},
    ],
    "tool_choice": "auto",
    "parallel_tool_calls": True,
    "reasoning": {"summary": "auto"},
    "store": False,
    "include": ["reasoning.encrypted_content"],
    "prompt_cache_key": "01a226e6-dac6-74b3-91be-fdceb394acd7",
    "client_metadata": {"session_id": "01a226e6", "x-codex-window-id": "01a226e6:0",
                        "x-codex-turn-metadata": '{"turn_id":"01a226e6-dad8"}'},
}  # fmt: skip
CODEX_HEADERS = {
    "authorization": "Bearer sk-local-unused",
    "originator": "codex_exec",
    "session-id": "01a226e6-dac6-74b3-91be-fdceb394acd7",
    "x-codex-turn-metadata": '{"installation_id":"2fbc","request_kind":"turn"}',
    "x-codex-beta-features": "remote_compaction_v2",
    "accept": "text/event-stream",
}


def test_codexs_turn_with_its_namespace_and_web_search_tools(tiny_chat):
    with tiny_chat.stream("POST", "/v1/responses", json=CODEX, headers=CODEX_HEADERS) as response:
        assert response.status_code == 200, response.read()
        events = _sse(response)
    names = [name for name, _ in events]
    assert names[:2] == ["response.created", "response.in_progress"]
    assert names[-1] in ("response.completed", "response.incomplete")  # the context's end
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    for item in events[-1][1]["response"]["output"]:
        if item["type"] == "function_call" and "." in item.get("namespace", "") + item["name"]:
            raise AssertionError(f"a namespaced call keeps its own name: {item}")


def test_codexs_compaction_turn_with_no_tools(tiny_chat):
    """When its context nears full, Codex asks for a summary of the turn so far: its calls and
    their outputs sent back (with the ids and status yaied gave them), ``tools: []`` and
    ``tool_choice: "auto"``."""
    call = {
        "type": "function_call",
        "status": "completed",
        "id": "fc_b650f5bf4b10_0",
        "name": "update_goal",
        "arguments": '{"status": "complete"}',
        "call_id": "call_1",
    }
    output = {
        "type": "function_call_output",
        "id": "fco_01a226ee-f82d",
        "call_id": "call_1",
        "output": "cannot update goal because this thread has no goal",
    }
    ask = _codex_message("user", "You are performing a CONTEXT CHECKPOINT COMPACTION. ...")
    body = {**CODEX, "input": [*CODEX["input"], call, output, ask], "tools": []}
    with tiny_chat.stream("POST", "/v1/responses", json=body, headers=CODEX_HEADERS) as response:
        assert response.status_code == 200, response.read()
        names = [name for name, _ in _sse(response)]
    assert names[-1] in ("response.completed", "response.incomplete")
