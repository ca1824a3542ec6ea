"""The one settings object; every environment override is listed here.

Environment variables (prefix ``AGENT_MEMORY_``):

- ``AGENT_MEMORY_CACHE_DIR``: root of converted models and KV caches
  (default ``$XDG_CACHE_HOME/langchain-agent-memory`` or ``~/.cache/langchain-agent-memory``).
- ``AGENT_MEMORY_MODEL``: default model, a shipped name (``smollm2-135m``, ``gemma3-270m``)
  or an mlx-lm model directory (default ``smollm2-135m``).
- ``AGENT_MEMORY_WEIGHT_DTYPE``: dtype of weights converted from a GGUF (default: ``float32``
  on the CPU, where only fp32 matmuls go through BLAS (see benchmarks/runtime.py);
  ``bfloat16`` on a GPU).
- ``AGENT_MEMORY_CHECKPOINTS``: where ``server_checkpointer`` (``langgraph.json``) keeps
  LangGraph checkpoints: a SQLite path or a ``postgresql://`` URL (default
  ``{cache_dir}/checkpoints.sqlite``).
- ``AGENT_MEMORY_STORE`` / ``AGENT_MEMORY_BLOCKS``: share agents' caches between workers on
  several hosts: records in PostgreSQL (``postgresql://...``), blocks in S3-compatible
  storage (``s3://bucket/prefix?endpoint=...``; credentials from ``AWS_*``). Both or neither
  (default: neither; the cache directory alone, no server needed).
- ``AGENT_MEMORY_HANDOFF_WAIT_S``: how long a worker whose request finds another worker's
  save of the agent in flight (its lease held) waits for that save's commit, to resume warm
  from it, before it goes on from what it has (default 10 s: a dead worker's lease expires
  within 10 s; a 48 MB save commits in ~1.3 s).
- ``AGENT_MEMORY_MAX_DISK_BYTES`` / ``AGENT_MEMORY_CACHE_TTL``: bound what each model's
  caches keep on disk (``5GB``; ``7d``): least recently used agents are evicted (default:
  unbounded; ``storage.budget``).
- ``AGENT_MEMORY_ATTENTION``: what a served agent attends over: ``stored`` (its stored 4-bit
  form, no full-precision copy: the default on a GPU) or ``copy`` (a full-precision working
  copy, kept for the most recent agents within a byte budget: the default on the CPU);
  ``engine.device.attention``.
- ``AGENT_MEMORY_BLAS``: ``bundled`` keeps mlx's own BLAS (read in ``engine/ops/runtime.py``,
  before pydantic is imported).
"""

from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, requires
from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

WeightDType = Literal["float32", "bfloat16", "float16"]
Attention = Literal["stored", "copy"]


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "langchain-agent-memory"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="AGENT_MEMORY_", extra="ignore")

    cache_dir: Path = Field(default_factory=_default_cache_dir)
    model: str = "smollm2-135m"
    weight_dtype: WeightDType | None = None  # None: by device (engine.device.weight_dtype)
    checkpoints: str | None = None  # None: {cache_dir}/checkpoints.sqlite
    store: str | None = None  # postgresql:// URL of a shared store's records
    blocks: str | None = None  # s3:// URL of a shared store's blocks
    #: Start with a shared store out of reach (serve from the local tier) instead of failing.
    lazy_store: bool = False
    #: Seconds a request waits for another worker's save of its agent in flight (hand-off).
    handoff_wait_s: float = Field(default=10.0, ge=0)
    max_disk_bytes: str | None = None  # a disk budget for each model's caches: "5GB", "500MiB", bytes
    cache_ttl: str | None = None  # evict caches unused for this long: "7d", "12h", seconds
    reserve_work: bool = True  # CPU: touch one agent's working-copy memory at engine start (kv.reserve)
    attention: Attention | None = None  # None: by device (engine.device.attention)


def get_settings() -> Settings:
    """Settings read from the environment now (cheap; not cached, so tests can override)."""
    return Settings()


def install_hint(extra: str) -> str:
    """A pip command that installs ``extra``'s requirements, read from the installed
    package's own metadata. NOTE: ``pip install 'langchain-agent-memory[server]'`` fails
    (the package is not on PyPI), and a user may hold a clone, a wheel or an editable
    install: the requirements themselves install from any of those."""
    markers = (f"extra == '{extra}'", f'extra == "{extra}"')
    try:
        listed = requires("langchain-agent-memory") or []
    except PackageNotFoundError:  # run from a source tree that was never installed
        listed = []
    wanted = [r.partition(";")[0].strip() for r in listed if any(m in r.partition(";")[2] for m in markers)]
    if not wanted:
        return f"pip install -e '.[{extra}]' in a clone of the repository"
    return "pip install " + " ".join(f"'{w}'" for w in wanted)
