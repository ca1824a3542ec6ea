"""The agent harnesses as installed (Claude Code and the Codex CLI, pinned by
``tests/harnesses/package-lock.json``) run against ``agent-memory serve`` on loopback with
the shipped chat model: a two-turn session completes with no 4xx or 5xx in the server's
log, its second turn reads >= 90 % of its prompt from the agent's cache, and a second
session's first turn reads the prefix the first session stored (a SHARED match).

Each harness's own prompt is shortened with its own flags (Claude Code's
``--system-prompt`` and ``--tools ""``; Codex's ``--disable`` of its feature tools) so that
a turn takes seconds on two CPU cores; ``benchmarks/harness.py`` runs them at full size.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from services import missing

from langchain_agent_memory.testing.harnesses import (
    ClaudeCode,
    CodexCli,
    PromptCounts,
    harness_bin,
    node_missing,
    prompt_counts,
)
from langchain_agent_memory.testing.server_process import free_port, start_server

MODEL = "smollm2-135m"
#: A system prompt of ~550 tokens: a session's shared prefix spans whole 256-token blocks.
SYSTEM = "You are a helpful assistant. " + " ".join(
    f"Rule {i}: answer the question you are asked in plain words and keep to the point." for i in range(1, 31)
)
#: Codex's feature tools (sub-agents, goals, the shell, images, apps, search) left out: its
#: prompt is then ~1K tokens instead of ~5K.
CODEX_FLAGS = [
    *("--disable", "multi_agent", "--disable", "goals", "--disable", "unified_exec"),
    *("--disable", "shell_tool", "--disable", "view_image", "--disable", "image_generation"),
    *("--disable", "skill_search", "--disable", "apps", "--disable", "plugins"),
    *("-c", "web_search=disabled"),
]
ACCESS_LINE = re.compile(r'"[A-Z]+ (\S+) HTTP/[\d.]+" (\d{3})')


@dataclass(frozen=True, slots=True)
class Server:
    url: str
    log: Path


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    if (why := node_missing()) is not None:
        missing(why)
    for name in ("claude", "codex"):
        if harness_bin(name) is None:  # Node is here: the install is what is missing
            pytest.fail(f"{name} is not installed in tests/harnesses: run scripts/setup.sh --dev")
    root = tmp_path_factory.mktemp("harnesses")
    port = free_port()
    args = ["-m", MODEL, "--cache-dir", str(root / "cache"), "--metrics-public"]
    args += ["--model-alias", f"claude-*={MODEL}"]  # Claude Code's main and background models
    proc = start_server(args, port, log=root / "serve.log")
    try:
        yield Server(f"http://127.0.0.1:{port}", root / "serve.log")
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _measured(server: Server, turn: Callable[[], object]) -> PromptCounts:
    """What ``turn`` read and prefilled, from the server's counters around it."""
    before = prompt_counts(server.url)
    turn()
    return prompt_counts(server.url) - before


def _errors_in_log(log: Path) -> list[str]:
    """The server's access-log lines with a 4xx or 5xx status."""
    return [
        line for line in log.read_text().splitlines() if (m := ACCESS_LINE.search(line)) and int(m[2]) >= 400
    ]


def _two_sessions(server: Server, first: Callable[[bool], object], second: Callable[[], object]) -> None:
    """Session one's two turns and session two's first; checked as the module says."""
    one = _measured(server, lambda: first(False))
    assert one.replies, "the first turn made no reply"
    two = _measured(server, lambda: first(True))
    assert two.reused_share >= 0.90, (
        f"turn 2 read {two.reused} of {two.reused + two.prefilled} from the cache"
    )
    assert set(two.replies) <= {"extend", "exact"}, two.replies
    three = _measured(server, second)
    # its own agent, no cache of its own: the leading whole blocks the first session stored
    assert three.reused_by("shared") >= 256, three
    assert not _errors_in_log(server.log), _errors_in_log(server.log)


def test_claude_code_two_turns_then_a_second_session(server: Server, tmp_path: Path) -> None:
    home, work = tmp_path / "home", tmp_path / "work"
    claude = ClaudeCode(
        server.url, home, work, args=["--system-prompt", SYSTEM, "--tools", ""], max_output_tokens=256
    )
    _two_sessions(
        server,
        lambda resume: claude.turn(
            "What is the capital of Italy?" if resume else "What is the capital of France?", resume=resume
        ),
        # its first characters differ from session one's where Claude Code's billing header
        # hashes them (the 5th, 8th and 21st): that header opens the system prompt
        lambda: claude.turn("Name the capital city of Spain."),
    )


def test_codex_two_turns_then_a_second_session(server: Server, tmp_path: Path) -> None:
    codex = CodexCli(server.url, MODEL, tmp_path / "codex-home", tmp_path / "work", args=CODEX_FLAGS)
    _two_sessions(
        server,
        lambda resume: codex.turn(
            "And of Greece?" if resume else "What is the capital of Portugal?", resume=resume
        ),
        lambda: codex.turn("What is the capital of Spain?"),
    )
