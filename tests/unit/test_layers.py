"""The package's floors, written as import-linter contracts in pyproject.toml: the engine
imports no LangChain (nor anything above it), no layer imports one above it, and no two
rooms of a folder import each other (a circle)."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import subprocess
import sys
import textwrap
from pathlib import Path

import langchain_agent_memory as package

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "langchain_agent_memory"


def test_import_contracts_hold() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run([str(lint)], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


def _package_classes() -> list[type]:
    modules = [
        importlib.import_module(m.name)
        for m in pkgutil.walk_packages(package.__path__, "langchain_agent_memory.")
    ]
    return [c for m in modules for c in vars(m).values() if inspect.isclass(c) and c.__module__ == m.__name__]


def _ours(cls: type) -> bool:
    """A class of the package that is a part of an implementation (a protocol is a
    contract: the classes that satisfy it are measured, not it)."""
    return cls.__module__.startswith("langchain_agent_memory.") and not getattr(cls, "_is_protocol", False)


def test_no_class_is_split_across_files_as_inherited_halves() -> None:
    """A size limit is met by smaller parts, not by moving half a class into a base in
    another file: a package base class that only one class inherits lives with it (a base
    that several share is a real one), no method stands for its host's with a
    ``NotImplementedError`` stub. (The line limits of earlier issues are retired, issue 67:
    a class is the size its one job needs, as ``ruff format`` lays it out.)"""
    classes = [c for c in _package_classes() if _ours(c)]
    heirs: dict[type, list[type]] = {}
    for cls in classes:
        for base in cls.__mro__[1:]:
            if _ours(base) and not issubclass(base, BaseException):
                heirs.setdefault(base, []).append(cls)
    halves = {
        f"{base.__module__}.{base.__qualname__}": f"{only.__module__}.{only.__qualname__}"
        for base, (only, *more) in heirs.items()
        if not more and base.__module__ != only.__module__
    }
    assert not halves, f"bases inherited by one class in another file (compose instead): {halves}"
    stubs = [
        f"{cls.__module__}.{cls.__qualname__}.{name}"
        for cls in classes
        for name, fn in vars(cls).items()
        if inspect.isfunction(fn) and _only_raises_not_implemented(fn)
    ]
    assert not stubs, f"methods that stand for a host's: {stubs}"


def _only_raises_not_implemented(fn: object) -> bool:
    try:
        source = inspect.getsource(fn)  # type: ignore[arg-type]
    except (OSError, TypeError):  # written by a library (a dataclass's __init__): not a stub
        return False
    body = ast.parse(textwrap.dedent(source)).body[0].body  # type: ignore[attr-defined]
    body = [s for s in body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    return len(body) == 1 and isinstance(body[0], ast.Raise) and "NotImplementedError" in ast.unparse(body[0])
