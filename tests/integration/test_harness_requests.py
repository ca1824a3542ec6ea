"""The requests the agent harnesses send, replayed over loopback (raw HTTP, as they send
them): Claude Code 2.1.197 (``POST /v1/messages?beta=true``) and the Codex CLI 0.171.0
(``POST /v1/responses``, ``GET /v1/models?client_version=``), captured against ``agent-memory
serve``. Their shapes are kept field for field (types, nesting, the values that matter);
their long texts (a 28K-character system prompt, 24 tools) are cut to a few words so the
session's small model reads them in seconds.

Before these were accepted, every first request of both harnesses was a 400: ``max_tokens``
over the limit, a ``system`` message inside ``messages``, ``namespace`` and ``web_search``
tools.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from services import app_on_loopback

from langchain_agent_memory.engine.model.loading import LoadedModel
from langchain_agent_memory.server import ServerConfig, create_app

MODEL = "smollm2-135m"
SESSION = "a385c0d2-a594-481c-86fd-afc2f0fe3453"
#: Claude Code's ``metadata.user_id``: a JSON object in a string.
USER_ID = json.dumps({"device_id": "e09add0fce8ebe53", "account_uuid": "", "session_id": SESSION})
SCHEMA = "https://json-schema.org/draft/2020-12/schema"


@pytest.fixture(scope="module")
def server(smollm: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    config = ServerConfig(
        models=[MODEL],
        cache_dir=str(tmp_path_factory.mktemp("harness-requests")),
        max_tokens_limit=256,
        model_aliases={"claude-*": MODEL, "gpt-*": MODEL, "gpt-5-codex": MODEL},
    )
    with app_on_loopback(create_app(config)) as url:
        yield url


def _events(response: httpx.Response) -> list[dict[str, Any]]:
    """The JSON ``data:`` payloads of an SSE reply."""
    return [
        json.loads(line[5:])
        for line in response.text.splitlines()
        if line.startswith("data:{") or line.startswith("data: {")
    ]


# ------------------------------------------------------------------ Claude Code


def _claude_tool(name: str, properties: dict[str, Any]) -> dict[str, Any]:
    schema = {"$schema": SCHEMA, "type": "object", "properties": properties, "additionalProperties": False}
    return {"name": name, "description": f"The {name} tool.", "input_schema": schema}


CLAUDE_TOOLS = [
    _claude_tool("Bash", {"command": {"type": "string"}, "timeout": {"type": "number"}}),
    _claude_tool("Read", {"file_path": {"type": "string"}}),
]


def _claude_request(turns: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """Claude Code's ``/v1/messages`` body: three system blocks (the last two cached), its
    tools, the session in ``metadata.user_id``, a 64000-token ``max_tokens``, adaptive
    thinking, ``context_management`` and ``output_config`` (unknown here), streamed."""
    return {
        "model": "claude-opus-4-8",
        "messages": turns,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197;"},
            {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
        ],
        "tools": CLAUDE_TOOLS,
        "metadata": {"user_id": USER_ID},
        "max_tokens": 64000,
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "stream": True,
        **extra,
    }


def _user(text: str) -> dict[str, Any]:
    reminder = "<system-reminder>\nToday's date is 2026-12-06.\n</system-reminder>\n\n"
    return {
        "role": "user",
        "content": [
            {"type": "text", "text": reminder},
            {"type": "text", "text": text, "cache_control": {"type": "ephemeral"}},
        ],
    }


#: Claude Code's mid-conversation system message (beta ``mid-conversation-system-2026-04-07``).
AGENT_TYPES = {"role": "system", "content": "Available agent types for the Agent tool:\n- claude: any task."}
CLAUDE_HEADERS = {
    "anthropic-version": "2023-06-01",
    "anthropic-beta": "claude-code-20250219,context-management-2025-06-27,mid-conversation-system-2026-04-07",
    "x-api-key": "sk-unused",
    "x-app": "cli",
    "x-claude-code-session-id": SESSION,
}


def _claude_post(server: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server}/v1/messages?beta=true", json=body, headers=CLAUDE_HEADERS, timeout=300)


def _message_delta(response: httpx.Response) -> dict[str, Any]:
    (delta,) = [e for e in _events(response) if e["type"] == "message_delta"]
    return delta


def test_claude_codes_session_runs_two_turns_on_its_own_agent_clamped(server: str) -> None:
    """Its first request (max_tokens 64000 over the limit, a system message inside
    ``messages``, unknown fields) is served, on the agent of its session; the second turn
    reads the first from that agent's cache."""
    first = _claude_post(server, _claude_request([_user("Say hi"), AGENT_TYPES]))
    assert first.status_code == 200, first.text
    assert first.headers["X-Max-Tokens-Clamped"].startswith("256;"), first.headers
    assert first.headers["X-Agent-ID"] == f"claude-code:{SESSION}"
    reply = "".join(e["delta"].get("text", "") for e in _events(first) if e["type"] == "content_block_delta")
    one = _message_delta(first)["usage"]
    assert one["output_tokens"] <= 256

    said = {"role": "assistant", "content": [{"type": "text", "text": reply}]}
    turns = [_user("Say hi"), AGENT_TYPES, said, _user("Say bye")]
    second = _claude_post(server, _claude_request(turns))
    assert second.status_code == 200, second.text
    two = _message_delta(second)["usage"]
    prompt = two["cache_read_input_tokens"] + two["cache_creation_input_tokens"]
    assert two["cache_read_input_tokens"] >= 0.9 * one["cache_creation_input_tokens"] > 0
    assert two["cache_read_input_tokens"] >= 0.5 * prompt, two

    agents = httpx.get(f"{server}/v1/agents", timeout=30).json()["data"]
    assert f"claude-code:{SESSION}" in {a["id"] for a in agents}
    assert not any(a["id"].startswith("{") for a in agents)  # never the JSON itself


def test_claude_code_with_a_thinking_budget_and_a_server_tool(server: str) -> None:
    """An older Claude Code's ``thinking`` (enabled, budget 31999) is read, not refused; an
    Anthropic server tool (``web_search_20250305``) is left out with a warning it sees."""
    body = _claude_request(
        [_user("Say hi")],
        stream=False,
        thinking={"type": "enabled", "budget_tokens": 31999},
        tools=[*CLAUDE_TOOLS, {"type": "web_search_20250305", "name": "web_search", "max_uses": 8}],
        metadata={"user_id": "plain-agent"},
    )
    r = _claude_post(server, body)
    assert r.status_code == 200, r.text
    assert "web_search (web_search_20250305)" in r.headers["X-Agent-Memory-Warning"]
    assert r.headers["X-Agent-ID"] == "plain-agent"  # a plain user_id is the agent itself


def test_unknown_fields_are_named_in_a_debug_line(server: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="langchain_agent_memory.server"):
        r = _claude_post(server, _claude_request([_user("Hi")], stream=False, max_tokens=4))
    assert r.status_code == 200, r.text
    said = [m for m in caplog.messages if "ignored fields" in m]
    assert said and "context_management" in said[0] and "output_config" in said[0], caplog.messages


def test_a_chat_completion_over_the_limit_is_clamped_not_refused(server: str) -> None:
    body = {
        "model": "gpt-4o",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 100_000,
        "client_metadata": {"x": 1},
    }
    r = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.headers["X-Max-Tokens-Clamped"].startswith("256;")
    assert r.json()["usage"]["completion_tokens"] <= 256


# ------------------------------------------------------------------ the Codex CLI


def _codex_function(name: str) -> dict[str, Any]:
    params = {
        "type": "object",
        "properties": {"cmd": {"type": "string"}},
        "required": ["cmd"],
        "additionalProperties": False,
    }
    return {
        "type": "function",
        "name": name,
        "description": f"{name}.",
        "strict": False,
        "parameters": params,
    }


CODEX_TOOLS = [
    _codex_function("exec_command"),
    {
        "type": "namespace",
        "name": "multi_agent_v1",
        "description": "Tools for spawning and managing sub-agents.",
        "tools": [_codex_function("close_agent"), _codex_function("spawn_agent")],
    },
    _codex_function("get_goal"),
    {"type": "web_search", "external_web_access": False},
]


def _codex_request(items: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """The Codex CLI's ``/v1/responses`` body (``codex exec``)."""
    return {
        "model": "gpt-5-codex",
        "input": items,
        "tools": CODEX_TOOLS,
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "01a24d5a-0205-7fa0-bc52-7908debe5ca8",
        "client_metadata": {"turn_id": "01a24d5a-021c", "x-codex-turn-metadata": "{}"},
        **extra,
    }


def _message(role: str, text: str) -> dict[str, Any]:
    kind = "output_text" if role == "assistant" else "input_text"
    return {"type": "message", "role": role, "content": [{"type": kind, "text": text}]}


CODEX_START = [
    _message("developer", "You are a coding agent running in the Codex CLI."),
    _message("user", "<environment_context>\n  <cwd>/tmp/work</cwd>\n</environment_context>"),
    _message("user", "Say hi"),
]
CODEX_HEADERS = {"authorization": "Bearer unused", "originator": "codex_exec", "accept": "text/event-stream"}


def _codex_post(server: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server}/v1/responses", json=body, headers=CODEX_HEADERS, timeout=300)


def _completed(response: httpx.Response) -> dict[str, Any]:
    (done,) = [
        e["response"] for e in _events(response) if e["type"] in ("response.completed", "response.incomplete")
    ]
    return done


def test_a_codex_session_of_two_turns_extends_its_agent(server: str) -> None:
    """Namespace tools flattened, ``web_search`` left out with a warning, ``include`` and
    ``client_metadata`` no 400; turn two (the whole history again) reads turn one from the
    cache."""
    first = _codex_post(server, _codex_request(CODEX_START))
    assert first.status_code == 200, first.text
    assert "web_search" in first.headers["X-Agent-Memory-Warning"]
    done = _completed(first)
    text = "".join(p["text"] for item in done["output"] if item["type"] == "message" for p in item["content"])
    history = [*CODEX_START, _message("assistant", text), _message("user", "Say bye")]
    second = _codex_post(server, _codex_request(history))
    assert second.status_code == 200, second.text
    usage = _completed(second)["usage"]
    assert usage["input_tokens_details"]["cached_tokens"] >= 0.9 * done["usage"]["input_tokens"] > 0


def test_a_namespaced_call_comes_back_named_as_codex_named_it(server: str) -> None:
    """A call of ``multi_agent_v1``'s ``close_agent`` is a ``function_call`` with ``name`` and
    ``namespace`` apart; sent back in the history, it reads as the model wrote it."""
    choice = {"type": "function", "name": "close_agent", "namespace": "multi_agent_v1"}
    body = _codex_request(CODEX_START, stream=False, tool_choice=choice, prompt_cache_key="codex-ns")
    r = _codex_post(server, body)
    assert r.status_code == 200, r.text
    (call,) = [item for item in r.json()["output"] if item["type"] == "function_call"]
    assert (call["name"], call["namespace"]) == ("close_agent", "multi_agent_v1")
    answer = {"type": "function_call_output", "call_id": call["call_id"], "output": "closed"}
    history = [
        *CODEX_START,
        {k: call[k] for k in ("type", "name", "namespace", "arguments", "call_id")},
        answer,
    ]
    again = _codex_post(server, _codex_request(history, stream=False, prompt_cache_key="codex-ns"))
    assert again.status_code == 200, again.text
    assert again.json()["agent_memory"]["cache"].endswith("extend"), again.json()["agent_memory"]


def test_codex_items_of_tools_the_model_cannot_run_are_left_out(server: str) -> None:
    searched = {"type": "web_search_call", "status": "completed", "action": {"type": "search"}}
    history = [*CODEX_START, searched, _message("user", "And now?")]
    r = _codex_post(server, _codex_request(history, stream=False))
    assert r.status_code == 200, r.text
    assert "web_search_call" in r.headers["X-Agent-Memory-Warning"]


def test_the_model_metadata_codex_reads(server: str) -> None:
    """``GET /v1/models?client_version=``: beside OpenAI's ``data``, Codex's ``models``: the
    served name and the exact aliases (Codex looks its model up by exact name), with the
    fields its catalog needs and the model's context."""
    r = httpx.get(f"{server}/v1/models", params={"client_version": "0.171.0"}, timeout=30)
    assert r.status_code == 200
    body = r.json()
    assert [m["id"] for m in body["data"]] == [MODEL]
    entries = {m["slug"]: m for m in body["models"]}
    assert set(entries) == {MODEL, "gpt-5-codex"}  # "claude-*" and "gpt-*" name no one model
    entry = entries["gpt-5-codex"]
    assert entry["display_name"] == MODEL and entry["context_window"] == 8192
    assert entry["shell_type"] == "shell_command" and entry["supported_in_api"] is True
    assert entry["apply_patch_tool_type"] is None and "web_search_tool_type" not in entry
    assert entry["truncation_policy"] == {"mode": "tokens", "limit": 10_000}
