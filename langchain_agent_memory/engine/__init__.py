"""The persistent KV engine (no LangChain imports), and its one door: the LangChain and
LangGraph rooms, the server and the command line import what they use from here, never
from a module behind it (an import-linter contract in pyproject.toml keeps it so).

NOTE: ``runtime`` first: it loads a fast BLAS into the process before anything imports
mlx (every module of the engine imports ``mx`` from it; importing this package makes the
order explicit whatever is imported first). The names below load on first use, so that
``agent-memory --help`` or a server's settings check does not import mlx-lm's models.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .ops import runtime  # noqa: F401

if TYPE_CHECKING:
    from .admin import AgentInfo, shared_blocks
    from .config import EngineConfig, load_model, resolve_model_dir
    from .engine import Engine
    from .errors import (
        AgentNotFoundError,
        BlockMissingError,
        BlocksUnavailableError,
        CacheFormatError,
        CacheWriteError,
        CommitConflictError,
        ContextLengthError,
        NewerFormatError,
        RemoteConfigError,
        RemoteUnavailableError,
        UnsupportedGGUFError,
        UnsupportedModelError,
    )
    from .kv import preset_name
    from .model.constrain import (
        JSON_OPTIONS,
        MAX_FREE_STRING_CHARS,
        GrammarConstraint,
        bounded_strings,
        json_schema_grammar,
        tool_call_grammar,
    )
    from .model.families import recorded_verdicts
    from .model.gguf_convert import convert_gguf
    from .model.hub import cached_snapshot, hub_cache_dir, parse_repo_id, snapshot_repo
    from .model.loading import (
        DEFAULT_MODEL,
        SHIPPED_MODELS,
        LoadedModel,
        conversion_progress,
        trained_context,
    )
    from .ops import device
    from .registry import engine_key, shared_engine, shutdown, unwatch_engines, watch_engines
    from .requests.commits import Subscription
    from .results import CacheOutcome, CacheSource, GenerationParams, GenerationResult, StreamChunk, Timings
    from .storage.agent_ids import INTERNAL_PREFIX, is_internal, validate_agent_id
    from .storage.block_writes import BlockWrites
    from .storage.blocks import AgentRecord, BlockHash
    from .storage.budget import StorageBudget, enforce, parse_age, parse_size
    from .storage.catalog import Catalog
    from .storage.pg_session import PgSession
    from .storage.remote import SharedBlockStore, open_store
    from .storage.status import StoreStatus
    from .storage.store import DiskBlockStore
    from .storage.store_config import StoreConfig

#: the module (under this package) that defines each public name
_EXPORTS: dict[str, tuple[str, ...]] = {
    "admin": ("AgentInfo", "shared_blocks"),
    "requests.commits": ("Subscription",),
    "config": (
        "EngineConfig",
        "load_model",
        "resolve_model_dir",
    ),
    "engine": ("Engine",),
    "errors": (
        "AgentNotFoundError",
        "BlockMissingError",
        "BlocksUnavailableError",
        "CacheFormatError",
        "CacheWriteError",
        "CommitConflictError",
        "ContextLengthError",
        "NewerFormatError",
        "RemoteConfigError",
        "RemoteUnavailableError",
        "UnsupportedGGUFError",
        "UnsupportedModelError",
    ),
    "kv": ("preset_name",),
    "model.constrain": (
        "JSON_OPTIONS",
        "MAX_FREE_STRING_CHARS",
        "GrammarConstraint",
        "bounded_strings",
        "json_schema_grammar",
        "tool_call_grammar",
    ),
    "model.families": ("recorded_verdicts",),
    "model.gguf_convert": ("convert_gguf",),
    "model.hub": (
        "cached_snapshot",
        "hub_cache_dir",
        "parse_repo_id",
        "snapshot_repo",
    ),
    "model.loading": (
        "DEFAULT_MODEL",
        "SHIPPED_MODELS",
        "LoadedModel",
        "conversion_progress",
        "trained_context",
    ),
    "registry": (
        "engine_key",
        "shared_engine",
        "shutdown",
        "unwatch_engines",
        "watch_engines",
    ),
    "results": (
        "CacheOutcome",
        "CacheSource",
        "GenerationParams",
        "GenerationResult",
        "StreamChunk",
        "Timings",
    ),
    "storage.agent_ids": (
        "INTERNAL_PREFIX",
        "is_internal",
        "validate_agent_id",
    ),
    "storage.blocks": ("AgentRecord", "BlockHash"),
    "storage.budget": (
        "StorageBudget",
        "enforce",
        "parse_age",
        "parse_size",
    ),
    "storage.catalog": ("Catalog",),
    "storage.pg_session": ("PgSession",),
    "storage.block_writes": ("BlockWrites",),
    "storage.remote": (
        "SharedBlockStore",
        "open_store",
    ),
    "storage.status": ("StoreStatus",),
    "storage.store": ("DiskBlockStore",),
    "storage.store_config": ("StoreConfig",),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = [
    "DEFAULT_MODEL",
    "INTERNAL_PREFIX",
    "JSON_OPTIONS",
    "MAX_FREE_STRING_CHARS",
    "SHIPPED_MODELS",
    "AgentInfo",
    "AgentNotFoundError",
    "AgentRecord",
    "BlockHash",
    "BlockMissingError",
    "BlockWrites",
    "BlocksUnavailableError",
    "CacheFormatError",
    "CacheOutcome",
    "CacheSource",
    "CacheWriteError",
    "Catalog",
    "CommitConflictError",
    "ContextLengthError",
    "DiskBlockStore",
    "Engine",
    "EngineConfig",
    "GenerationParams",
    "GenerationResult",
    "GrammarConstraint",
    "LoadedModel",
    "NewerFormatError",
    "PgSession",
    "RemoteConfigError",
    "RemoteUnavailableError",
    "SharedBlockStore",
    "StorageBudget",
    "StoreConfig",
    "StoreStatus",
    "StreamChunk",
    "Subscription",
    "Timings",
    "UnsupportedGGUFError",
    "UnsupportedModelError",
    "bounded_strings",
    "cached_snapshot",
    "conversion_progress",
    "convert_gguf",
    "device",
    "enforce",
    "engine_key",
    "hub_cache_dir",
    "is_internal",
    "json_schema_grammar",
    "load_model",
    "open_store",
    "parse_age",
    "parse_repo_id",
    "parse_size",
    "preset_name",
    "recorded_verdicts",
    "resolve_model_dir",
    "shared_blocks",
    "shared_engine",
    "shutdown",
    "snapshot_repo",
    "tool_call_grammar",
    "trained_context",
    "unwatch_engines",
    "validate_agent_id",
    "watch_engines",
]


def __getattr__(name: str) -> Any:
    if name == "device":  # a module: what runs where
        return importlib.import_module(f"{__name__}.ops.device")
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value  # looked up once
    return value
