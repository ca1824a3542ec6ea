"""What ``serve`` says of itself to a newcomer: its help names every API it serves, and its
start-up summary says what is true of this server (metrics behind a key only when there
is one, the context scale when one is set)."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from langchain_agent_memory.cli.main import app, startup_summary
from langchain_agent_memory.server import ServerConfig


def _help(*args: str) -> str:
    result = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "200", "TERM": "dumb"})
    assert result.exit_code == 0, result.output
    return " ".join(result.output.split())


def test_the_help_names_every_api_serve_serves() -> None:
    serve = _help("serve")
    for api in ("Chat Completions", "Responses", "Messages"):
        assert api in serve, serve[:400]
    top = _help()
    for route in ("/v1/chat/completions", "/v1/responses", "/v1/messages"):
        assert route in top, top[:800]


def test_the_summary_says_metrics_need_no_key_when_there_is_none() -> None:
    summary = startup_summary(ServerConfig(models=["smollm2-135m"]), "127.0.0.1", 8000)
    (line,) = [line for line in summary.splitlines() if "metrics:" in line]
    assert "no key" in line and "behind the key" not in line
    keyed = startup_summary(ServerConfig(models=["smollm2-135m"], api_key="k"), "127.0.0.1", 8000)
    assert "behind the key" in keyed


def test_the_summary_names_the_context_scale() -> None:
    summary = startup_summary(ServerConfig(models=["smollm2-135m"], context_scale=25.0), "127.0.0.1", 8000)
    assert "x25 (--context-scale)" in summary
    assert "--context-scale" not in startup_summary(ServerConfig(models=["smollm2-135m"]), "127.0.0.1", 8000)


def test_the_cli_guide_names_models_check() -> None:
    guide = (Path(__file__).parents[2] / "docs" / "guides" / "cli.md").read_text(encoding="utf-8")
    assert "models --check MODEL" in guide
