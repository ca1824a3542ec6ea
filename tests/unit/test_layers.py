"""The package's floors, written as import-linter contracts in pyproject.toml: the engine
imports no LangChain (nor anything above it), no layer imports one above it, and no two
rooms of a folder import each other (a circle)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_import_contracts_hold() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run([str(lint)], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


def test_no_package_file_is_over_500_lines_and_the_engine_facade_under_200() -> None:
    """Small rooms a newcomer can read: a file that grows past 500 lines is split by what it
    holds; the facade (``Engine``) stays a facade."""
    import ast

    package = ROOT / "langchain_agent_memory"
    long = {
        str(p.relative_to(ROOT)): n
        for p in sorted(package.rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > 500
    }
    assert not long, long
    tree = ast.parse((package / "engine" / "engine.py").read_text())
    (engine,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine"]
    assert engine.end_lineno - engine.lineno + 1 < 200  # type: ignore[operator]
