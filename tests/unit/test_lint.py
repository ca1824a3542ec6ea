"""The code base stays ruff clean (lint and format), checked in CI with the tests."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_check() -> None:
    out = subprocess.run([sys.executable, "-m", "ruff", "check", str(ROOT)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_ruff_format() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", str(ROOT)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr


def _assigned_attributes(tree: ast.AST) -> list[tuple[str, int]]:
    """(root name, line) of every ``root.attr... = value`` / ``setattr(root, ...)``."""
    found = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in {"setattr", "delattr"}
        ):
            targets = [ast.Attribute(value=node.args[0], attr="?")] if node.args else []
        for target in targets:
            while isinstance(target, (ast.Attribute, ast.Subscript)):
                target = target.value
                if isinstance(target, ast.Name):
                    found.append((target.id, node.lineno))
    return found


def test_nothing_assigns_to_another_librarys_modules_or_classes() -> None:
    """mlx-lm (and mlx, langchain, langgraph) are never patched for the whole process: no
    name imported from them is assigned to, and nothing calls setattr on them. The one
    instance-level change (a module instance of one loaded model switched to a subclass,
    in engine/adapters.py) is the only ``__class__`` assignment."""
    foreign = ("mlx_lm", "mlx", "langchain_core", "langgraph", "transformers")
    offenders = []
    for path in sorted((ROOT / "langchain_agent_memory").rglob("*.py")):
        tree = ast.parse(path.read_text())
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported |= {
                    (a.asname or a.name).split(".")[0] for a in node.names if a.name.startswith(foreign)
                }
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(foreign):
                imported |= {a.asname or a.name for a in node.names}
            elif (  # module = importlib.import_module("mlx_lm....")
                isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Call)
                and "import_module" in ast.unparse(node.value.func)
            ):
                imported |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        offenders += [
            f"{path.name}:{line} assigns to {name}"
            for name, line in _assigned_attributes(tree)
            if name in imported
        ]
        text = path.read_text()
        if "__class__ =" in text and path.name != "adapters.py":
            offenders.append(f"{path.name}: assigns __class__")
        if "setattr(" in text:
            offenders.append(f"{path.name}: calls setattr")
    assert not offenders, offenders
