"""The engine's one door (``langchain_agent_memory.engine``): one list of names, each loaded
on first use, and no store class among them (the rooms above reach stores through
``StoreAdmin``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import langchain_agent_memory.engine as facade

#: what the rooms above once imported to reach a store, and now reach through StoreAdmin
STORE_CLASSES = [
    "Catalog", "DiskBlockStore", "SharedBlockStore", "open_store", "BlockPool", "PgSession",
    "StoreConfig", "StoreStatus", "enforce", "BlockHash",
]  # fmt: skip


def _fresh(code: str) -> str:
    """``code``'s output in a new interpreter (what it imports is its own)."""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    return done.stdout.strip()


def test_every_exported_name_loads_from_its_module() -> None:
    for name in facade.__all__:
        value = getattr(facade, name)  # an AttributeError or ImportError names a wrong home
        assert vars(facade)[name] is value  # looked up once
    assert set(facade.__all__) <= set(dir(facade))


def test_a_name_the_facade_does_not_export_is_an_attribute_error() -> None:
    for name in STORE_CLASSES:
        assert name not in facade.__all__
        with pytest.raises(AttributeError):
            getattr(facade, name)


def test_importing_the_facade_loads_no_engine_module_until_a_name_is_used() -> None:
    out = _fresh(
        "import sys, langchain_agent_memory.engine as e\n"
        "print('langchain_agent_memory.engine.engine' in sys.modules, "
        "'langchain_agent_memory.engine.store_admin' in sys.modules)\n"
        "e.StoreAdmin\n"
        "print('langchain_agent_memory.engine.store_admin' in sys.modules)"
    )
    assert out.splitlines() == ["False False", "True"]


def test_the_command_lines_help_imports_no_model_of_mlx_lm() -> None:
    out = _fresh(
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from langchain_agent_memory.cli.main import app\n"
        "assert CliRunner().invoke(app, ['cache', '--help']).exit_code == 0\n"
        "print(sorted(m for m in sys.modules if m.startswith('mlx_lm.models')))"
    )
    assert out == "[]"
