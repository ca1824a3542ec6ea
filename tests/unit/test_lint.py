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


def _assigned_attributes(tree: ast.AST) -> list[tuple[str, int, list[str]]]:
    """(root name, line, the attributes after it) of every ``root.attr... = value`` /
    ``setattr(root, ...)``."""
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
            chain: list[str] = []
            while isinstance(target, (ast.Attribute, ast.Subscript)):
                if isinstance(target, ast.Attribute):
                    chain.insert(0, target.attr)
                target = target.value
                if isinstance(target, ast.Name):
                    found.append((target.id, node.lineno, chain[:-1] if chain else []))
    return found


FOREIGN = ("mlx_lm", "mlx", "langchain_core", "langgraph", "transformers")


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` in ``module`` names."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _foreign_names(package: Path) -> dict[Path, set[str]]:
    """Per file of ``package``: the names that stand for another library's modules or
    objects: imported from it, assigned from such a name, or imported from a module of the
    package that holds one (``from ..runtime import mx``: runtime's ``mx`` is mlx.core),
    followed to a fixed point."""
    trees = {path: ast.parse(path.read_text()) for path in sorted(package.rglob("*.py"))}
    names = {path: _module_name(path, package) for path in trees}
    by_module = {names[path]: path for path in trees}
    foreign: dict[Path, set[str]] = {path: set() for path in trees}
    changed = True
    while changed:
        changed = False
        for path, tree in trees.items():
            found = set(foreign[path])
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    found |= {
                        (a.asname or a.name).split(".")[0] for a in node.names if a.name.startswith(FOREIGN)
                    }
                elif isinstance(node, ast.ImportFrom):
                    source = _resolve(names[path], path.name == "__init__.py", node)
                    if source.startswith(FOREIGN):
                        found |= {a.asname or a.name for a in node.names}
                    elif source in by_module:
                        held = foreign[by_module[source]]
                        found |= {a.asname or a.name for a in node.names if a.name in held}
                elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) for t in node.targets):
                    value = node.value
                    while isinstance(value, ast.Attribute):
                        value = value.value
                    from_foreign = isinstance(value, ast.Name) and value.id in found
                    if from_foreign or (  # module = importlib.import_module("mlx_lm....")
                        isinstance(node.value, ast.Call) and "import_module" in ast.unparse(node.value.func)
                    ):
                        found |= {t.id for t in node.targets if isinstance(t, ast.Name)}
            if found != foreign[path]:
                foreign[path], changed = found, True
    return foreign


def _module_aliases(package: Path, path: Path) -> dict[str, str]:
    """Names in ``path`` that stand for a module of ``package`` (``from .engine import
    runtime``, ``import pkg.engine.runtime as runtime``), with the module each names."""
    names = {_module_name(p, package) for p in package.rglob("*.py")}
    module = _module_name(path, package)
    aliases = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            source = _resolve(module, path.name == "__init__.py", node)
            aliases |= {
                a.asname or a.name: f"{source}.{a.name}" for a in node.names if f"{source}.{a.name}" in names
            }
        elif isinstance(node, ast.Import):
            aliases |= {a.asname: a.name for a in node.names if a.asname and a.name in names}
    return aliases


def patch_offenders(package: Path) -> list[str]:
    """Assignments to, and setattr on, another library's modules or classes in ``package``:
    through a name that stands for one, or through a module of the package that holds one
    (``runtime.mx.fast.rms_norm = ...``)."""
    foreign = _foreign_names(package)
    held = {_module_name(path, package): names for path, names in foreign.items()}
    offenders = []
    for path, names in foreign.items():
        text = path.read_text()
        modules = _module_aliases(package, path)
        for name, line, chain in _assigned_attributes(ast.parse(text)):
            through = name in modules and bool(chain) and chain[0] in held.get(modules[name], set())
            if name in names or through:
                offenders.append(f"{path.name}:{line} assigns to {name}")
        if "__class__ =" in text and path.name != "adapters.py":
            offenders.append(f"{path.name}: assigns __class__")
        if "setattr(" in text:
            offenders.append(f"{path.name}: calls setattr")
    return offenders


def test_nothing_assigns_to_another_librarys_modules_or_classes() -> None:
    """mlx-lm (and mlx, langchain, langgraph) are never patched for the whole process: no
    name that stands for them (imported, or handed on by a module of ours, as runtime hands
    out ``mx``) is assigned to, and nothing calls setattr on them. The one instance-level
    change (a module instance of one loaded model switched to a subclass) goes through
    ``adapters.switch_instance_class``, the only ``__class__`` assignment."""
    assert not patch_offenders(ROOT / "langchain_agent_memory")


def test_an_assignment_through_a_re_exported_alias_is_caught(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "engine").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "engine" / "__init__.py").write_text("")
    (pkg / "engine" / "runtime.py").write_text("import mlx.core as mx\n")
    (pkg / "engine" / "ops.py").write_text("from .runtime import mx\nfast = mx.fast\n")
    (pkg / "chat.py").write_text(
        "from pkg.engine.ops import fast\nfrom .engine import runtime\n"
        "def go():\n    fast.scaled_dot_product_attention = None\n"
    )
    (pkg / "other.py").write_text("from .engine.runtime import mx\nmx.fast.rms_norm = None\n")
    (pkg / "through.py").write_text("from .engine import runtime\nruntime.mx.fast.rms_norm = None\n")
    (pkg / "fine.py").write_text("from .engine.runtime import mx\nclass A:\n    pass\nA.x = mx.array(1)\n")
    found = patch_offenders(pkg)
    assert sorted(found) == [
        "chat.py:4 assigns to fast",
        "other.py:2 assigns to mx",
        "through.py:2 assigns to runtime",
    ], found
