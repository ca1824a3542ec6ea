"""One config, built once: an engine's settings come from what the caller gave, else the
environment (``AGENT_MEMORY_*``), else the device; nothing below ``engine/config.py`` reads
the environment, and nothing in the package writes it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from langchain_agent_memory.engine import EngineConfig, StorageBudget, device
from langchain_agent_memory.engine.storage.objects import RemoteConfigError
from langchain_agent_memory.engine.storage.store_config import StoreConfig

PACKAGE = Path(__file__).resolve().parents[2] / "langchain_agent_memory"
PG, S3 = "postgresql://u@127.0.0.1:1/db", "s3://bucket/p?endpoint=http://127.0.0.1:1"


def test_an_argument_beats_the_environment_which_beats_the_device(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in (
        "ATTENTION",
        "STORE",
        "BLOCKS",
        "LAZY_STORE",
        "HANDOFF_WAIT_S",
        "MAX_DISK_BYTES",
        "CACHE_TTL",
    ):
        monkeypatch.delenv(f"AGENT_MEMORY_{name}", raising=False)
    monkeypatch.setenv("AGENT_MEMORY_CACHE_DIR", str(tmp_path / "env"))
    device_default = EngineConfig.resolve()
    assert device_default.attention == device.attention() and device_default.store is None
    assert device_default.cache_dir == tmp_path / "env" and device_default.storage_budget is None
    assert device_default.hot_budget_bytes == device.hot_budget_bytes()

    other = "copy" if device.attention() == "stored" else "stored"
    monkeypatch.setenv("AGENT_MEMORY_ATTENTION", other)
    monkeypatch.setenv("AGENT_MEMORY_STORE", PG)
    monkeypatch.setenv("AGENT_MEMORY_BLOCKS", S3)
    monkeypatch.setenv("AGENT_MEMORY_LAZY_STORE", "1")
    monkeypatch.setenv("AGENT_MEMORY_HANDOFF_WAIT_S", "2.5")
    monkeypatch.setenv("AGENT_MEMORY_MAX_DISK_BYTES", "5GB")
    from_env = EngineConfig.resolve()
    assert from_env.attention == other
    assert from_env.store == StoreConfig(PG, S3, lazy=True, handoff_wait_s=2.5)
    assert from_env.storage_budget == StorageBudget.of("5GB", None)

    given = EngineConfig.resolve(
        attention=device.attention(), cache_dir=tmp_path / "arg", lazy_store=False, handoff_wait_s=0,
        max_disk_bytes="1GB", hot_budget_bytes=1 << 20,
    )  # fmt: skip
    assert given.attention == device.attention() and given.cache_dir == tmp_path / "arg"
    assert given.store == StoreConfig(PG, S3, lazy=False, handoff_wait_s=0)
    assert given.storage_budget == StorageBudget.of("1GB", None) and given.hot_budget_bytes == 1 << 20


def test_wrong_settings_fail_when_the_config_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AGENT_MEMORY_BLOCKS", raising=False)
    with pytest.raises(RemoteConfigError, match="both store="):
        EngineConfig.resolve(store=PG)
    with pytest.raises(ValueError, match="attention must be"):
        EngineConfig.resolve(attention="fast")
    with pytest.raises(ValueError, match="handoff_wait_s"):
        EngineConfig.resolve(store=PG, blocks=S3, handoff_wait_s=-1)


def test_the_same_settings_name_the_same_engine(tmp_path: Path) -> None:
    """The registry keys on ``config.key``: how the store starts and the budgets do not make
    another engine; the model, directory, KV format and store do."""
    a = EngineConfig.resolve("smollm2-135m", cache_dir=tmp_path, hot_budget_bytes=1 << 20)
    assert a.key == EngineConfig.resolve("smollm2-135m", cache_dir=tmp_path, max_disk_bytes="1GB").key
    assert a.key != EngineConfig.resolve("smollm2-135m", cache_dir=tmp_path, kv_bits=8).key
    assert a.key != EngineConfig.resolve("smollm2-135m", cache_dir=tmp_path / "other").key


def test_nothing_below_the_engine_config_reads_the_settings_or_writes_the_environment() -> None:
    """``get_settings()`` is read by ``engine/config.py`` alone in the engine (a ``load_model``
    called on its own gets its defaults there: ``engine.config.load_model``), and by the rooms
    above the engine; no setting travels through ``os.environ`` (the command line hands
    ``--lazy-store`` down in the config, as every other option)."""
    readers, writers = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        rel = str(path.relative_to(PACKAGE))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("get_settings"):
                readers.append(rel)
            if isinstance(node, ast.Assign) and any("environ" in ast.unparse(t) for t in node.targets):
                writers.append(f"{rel}: {ast.unparse(node)}")
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith(
                ("environ.update", "environ.setdefault", "putenv")
            ):
                writers.append(f"{rel}: {ast.unparse(node)}")
    below = sorted({r for r in readers if r.startswith("engine/")})
    assert below == ["engine/config.py"], below
    # the native libraries' own switches, set before they load, are the only writes
    assert all(w.startswith("engine/ops/runtime.py") and "AGENT_MEMORY" not in w for w in writers), writers
