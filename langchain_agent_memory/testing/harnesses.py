"""The agent harnesses as installed: Claude Code and the Codex CLI from ``tests/harnesses``
(pinned by its ``package-lock.json``, installed there by ``scripts/setup.sh --dev``), run
against a server the way a user runs them (``claude -p`` / ``--continue``, ``codex exec`` /
``resume --last``), each in a home of its own so that nothing of the user's leaks in; and
the server's prompt-token counters read around each turn (``GET /metrics``), which say
what the turn's replies read from the cache."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Where ``setup.sh --dev`` installs the pinned harnesses (``node_modules/.bin``).
HARNESS_DIR = Path(__file__).resolve().parents[2] / "tests" / "harnesses"


def harness_bin(name: str) -> Path | None:
    """The installed harness ``name`` (``claude``, ``codex``), or None."""
    path = HARNESS_DIR / "node_modules" / ".bin" / name
    return path if path.exists() else None


def node_missing() -> str | None:
    """Why the harnesses cannot run here (no Node.js), or None."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        return "Node.js and npm are not installed (Debian: apt-get install nodejs npm), so neither harness"
    return None


@dataclass(frozen=True, slots=True)
class PromptCounts:
    """A server's prompt tokens so far, by cache outcome (``match``: exact, extend, shared,
    ...) and part (``reused`` from a cache, ``prefilled``), and its replies by outcome."""

    tokens: Counter[tuple[str, str]] = field(default_factory=Counter)
    replies: Counter[str] = field(default_factory=Counter)

    def __sub__(self, before: PromptCounts) -> PromptCounts:
        return PromptCounts(self.tokens - before.tokens, self.replies - before.replies)

    @property
    def reused(self) -> int:
        return sum(n for (_, part), n in self.tokens.items() if part == "reused")

    @property
    def prefilled(self) -> int:
        return sum(n for (_, part), n in self.tokens.items() if part == "prefilled")

    @property
    def reused_share(self) -> float:
        """Of the prompt tokens, the share read from a cache."""
        return self.reused / max(self.reused + self.prefilled, 1)

    def reused_by(self, match: str) -> int:
        return self.tokens[(match, "reused")]


def prompt_counts(url: str, headers: dict[str, str] | None = None) -> PromptCounts:
    """``url``'s ``/metrics`` (every model summed)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(f"{url}/metrics", headers=headers, timeout=30)
    r.raise_for_status()
    tokens: Counter[tuple[str, str]] = Counter()
    replies: Counter[str] = Counter()
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            if s.name == "agent_memory_prompt_tokens_total":
                tokens[(s.labels["match"], s.labels["part"])] += int(s.value)
            elif s.name == "agent_memory_replies_total":
                replies[s.labels["match"]] += int(s.value)
    return PromptCounts(tokens, replies)


def _run(argv: Sequence[str], env: dict[str, str], cwd: Path, timeout_s: float, check: bool = True) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout_s)
    if check and done.returncode != 0:
        raise RuntimeError(
            f"{Path(argv[0]).name} exited {done.returncode}: {(done.stderr or done.stdout)[-3000:]}"
        )
    return done.stdout


def _home_env(home: Path, **extra: str) -> dict[str, str]:
    """This process's environment with ``HOME`` (and XDG's folders) moved to ``home``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("ANTHROPIC_", "OPENAI_", "CLAUDE_", "CODEX_"))
    }
    env.update(HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"), XDG_CACHE_HOME=str(home / ".cache"))
    env.update(extra)
    return env


@dataclass(slots=True)
class ClaudeCode:
    """``claude -p`` against ``url`` (its Anthropic base URL), HOME in ``home``, run in
    ``work`` (``--continue`` goes on with that folder's latest session). ``args``: its own
    flags (``--system-prompt``, ``--tools``) that shorten its prompt."""

    url: str
    home: Path
    work: Path
    args: Sequence[str] = ()
    max_output_tokens: int | None = None
    timeout_s: float = 600
    exe: Path | None = field(default_factory=lambda: harness_bin("claude"))

    def turn(self, prompt: str, *, resume: bool = False, check: bool = True) -> dict[str, Any]:
        """One turn (a new session, or ``resume``: ``--continue``); its JSON result.
        ``check``: raise where Claude Code says the turn failed (a reply cut by
        ``max_tokens`` is one: a base model that never stops)."""
        assert self.exe is not None, "Claude Code is not installed: scripts/setup.sh --dev"
        self.work.mkdir(parents=True, exist_ok=True)
        env = _home_env(
            self.home,
            ANTHROPIC_BASE_URL=self.url,
            ANTHROPIC_API_KEY="sk-unused",
            # no update checks, telemetry or error reports: loopback only
            CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
            DISABLE_AUTOUPDATER="1",
            # a cold prefill on a CPU is slower than its default request timeout
            API_TIMEOUT_MS=str(int(self.timeout_s * 1000)),
        )
        if self.max_output_tokens is not None:
            env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(self.max_output_tokens)
        argv = [str(self.exe), "-p", prompt, *(["--continue"] if resume else []), *self.args]
        out = _run([*argv, "--output-format", "json"], env, self.work, self.timeout_s, check)
        result: dict[str, Any] = json.loads(out)
        if check and result.get("is_error"):
            raise RuntimeError(f"Claude Code's turn failed: {result.get('result')}")
        return result


@dataclass(slots=True)
class CodexCli:
    """``codex exec`` against ``url`` (the server's root) serving ``model``, its home
    (``CODEX_HOME``, with the provider entry the server guide shows) in ``home``, run in
    ``work``. ``args``: its own flags (``--disable FEATURE``, ``-c``) that shorten its
    prompt."""

    url: str
    model: str
    home: Path
    work: Path
    args: Sequence[str] = ()
    timeout_s: float = 600
    exe: Path | None = field(default_factory=lambda: harness_bin("codex"))

    def __post_init__(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / "config.toml").write_text(
            f'model = "{self.model}"\n'
            'model_provider = "agent-memory"\n\n'
            "[model_providers.agent-memory]\n"
            'name = "agent-memory"\n'
            f'base_url = "{self.url}/v1"\n'
            'wire_api = "responses"\n'
            'env_key = "AGENT_MEMORY_KEY"\n'
            f'model_catalog_url = "{self.url}/v1/models"\n'
            f"stream_idle_timeout_ms = {int(self.timeout_s * 1000)}\n"
        )

    def turn(self, prompt: str, *, resume: bool = False, check: bool = True) -> str:
        """One turn (a new session, or ``resume``: ``resume --last``); what it printed.
        ``check``: raise where it exits with an error (a reply cut by the server's
        ``--max-tokens-limit`` is one)."""
        assert self.exe is not None, "the Codex CLI is not installed: scripts/setup.sh --dev"
        self.work.mkdir(parents=True, exist_ok=True)
        env = _home_env(self.home, CODEX_HOME=str(self.home), AGENT_MEMORY_KEY="unused")
        argv = [str(self.exe), "exec", "--skip-git-repo-check", *self.args]
        argv += ["resume", "--last", prompt] if resume else [prompt]
        return _run(argv, env, self.work, self.timeout_s, check)
