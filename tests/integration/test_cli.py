"""The ``agent-memory`` command line on a real cache directory (real model, real files)."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from langchain_agent_memory import corpus
from langchain_agent_memory.cli import app
from langchain_agent_memory.engine.engine import Engine, GenerationParams
from langchain_agent_memory.engine.models import LoadedModel

SYSTEM = "You answer questions about this license.\n\n" + corpus.apache_license()[:1500]


def _run(*args: str) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.output


def test_cache_commands(smollm: LoadedModel, tmp_path: Path) -> None:
    engine = Engine("smollm2-135m", cache_dir=tmp_path)
    for agent, question in (("t1:lawyer", "Its name?"), ("t2:lawyer", "Who wrote it?")):
        engine.generate(agent, f"{SYSTEM}\nQ: {question}\nA:", GenerationParams(max_tokens=2))
    shared = engine.store.get_agent("t1:lawyer").blocks[0]  # type: ignore[union-attr]
    d = str(tmp_path)

    listing = _run("cache", "ls", "--cache-dir", d)
    assert "t1:lawyer" in listing and "t2:lawyer" in listing
    assert "t2:lawyer" not in _run("cache", "ls", "--prefix", "t1:", "--cache-dir", d)
    shown = _run("cache", "show", "t1:lawyer", "--cache-dir", d)
    assert f"tokens: {engine.cached_tokens('t1:lawyer')}" in shown and "Apache" in shown

    assert "deleted 1 agent cache" in _run("cache", "rm", "t1:lawyer", "--cache-dir", d)
    assert engine.store.get_agent("t1:lawyer") is None
    assert engine.store.has_block(shared)  # t2 still names it
    missing = CliRunner().invoke(app, ["cache", "show", "t1:lawyer", "--cache-dir", d])
    assert missing.exit_code != 0 and "no stored cache" in missing.output

    orphan_dir = engine.store.block_path(shared).parent
    (orphan_dir / f".{shared}.safetensors.x.safetensors").write_bytes(b"half")  # a killed save's temp file
    assert "removed 1 temporary file(s)" in _run("cache", "gc", "--cache-dir", d)
    usage = _run("cache", "du", "--cache-dir", d)
    assert engine.fingerprint[:20] in usage
    assert "Usage" in _run("cache", "--help")
