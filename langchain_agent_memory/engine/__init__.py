"""The persistent KV engine (no LangChain imports), and its one door: the LangChain and
LangGraph rooms, the server and the command line import what they use from here, never
from a module behind it (an import-linter contract in pyproject.toml keeps it so). They
reach stored caches through ``StoreAdmin`` and the engine's own ``Engine.admin``: no
store, catalog, pool or session class is named here (another contract: this module
imports nothing from ``storage``).

NOTE: ``runtime`` first: it loads a fast BLAS into the process before anything imports
mlx (every module of the engine imports ``mx`` from it; importing this package makes the
order explicit whatever is imported first). The names below load on first use, so that
``agent-memory --help`` or a server's settings check does not import mlx-lm's models.

The imports under ``TYPE_CHECKING`` are the one list of this door's names: type checkers
and IDEs read them (``X as X``: a re-export), import-linter sees what the door opens onto,
and at run time ``_homes`` reads the same statements from this file to load each name
from its module on first use (and to make ``__all__``), so no second list can drift.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .ops import runtime  # noqa: F401

if TYPE_CHECKING:
    from .admin import shared_blocks as shared_blocks
    from .config import EngineConfig as EngineConfig
    from .config import load_model as load_model
    from .config import resolve_model_dir as resolve_model_dir
    from .engine import Engine as Engine
    from .errors import AgentNotFoundError as AgentNotFoundError
    from .errors import BlockMissingError as BlockMissingError
    from .errors import CacheWriteError as CacheWriteError
    from .errors import CommitConflictError as CommitConflictError
    from .errors import ContextLengthError as ContextLengthError
    from .errors import RemoteUnavailableError as RemoteUnavailableError
    from .errors import UnsupportedGGUFError as UnsupportedGGUFError
    from .errors import UnsupportedModelError as UnsupportedModelError
    from .kv import preset_name as preset_name
    from .model.constrain import JSON_OPTIONS as JSON_OPTIONS
    from .model.constrain import MAX_FREE_STRING_CHARS as MAX_FREE_STRING_CHARS
    from .model.constrain import GrammarConstraint as GrammarConstraint
    from .model.constrain import bounded_strings as bounded_strings
    from .model.constrain import json_schema_grammar as json_schema_grammar
    from .model.constrain import tool_call_grammar as tool_call_grammar
    from .model.families import recorded_verdicts as recorded_verdicts
    from .model.gguf_convert import convert_gguf as convert_gguf
    from .model.hub import cached_snapshot as cached_snapshot
    from .model.hub import hub_cache_dir as hub_cache_dir
    from .model.hub import parse_repo_id as parse_repo_id
    from .model.loading import DEFAULT_MODEL as DEFAULT_MODEL
    from .model.loading import SHIPPED_MODELS as SHIPPED_MODELS
    from .model.loading import LoadedModel as LoadedModel
    from .model.loading import conversion_progress as conversion_progress
    from .model.loading import trained_context as trained_context
    from .ops import device as device
    from .registry import shared_engine as shared_engine
    from .registry import shutdown as shutdown
    from .registry import unwatch_engines as unwatch_engines
    from .registry import watch_engines as watch_engines
    from .requests.commits import Subscription as Subscription
    from .results import GenerationParams as GenerationParams
    from .results import GenerationResult as GenerationResult
    from .results import StreamChunk as StreamChunk
    from .store_admin import INTERNAL_PREFIX as INTERNAL_PREFIX
    from .store_admin import AgentRecord as AgentRecord
    from .store_admin import ModelStore as ModelStore
    from .store_admin import StorageBudget as StorageBudget
    from .store_admin import StoreAdmin as StoreAdmin
    from .store_admin import database_session as database_session
    from .store_admin import is_internal as is_internal
    from .store_admin import parse_age as parse_age
    from .store_admin import parse_size as parse_size
    from .store_admin import validate_agent_id as validate_agent_id


def _homes() -> dict[str, str]:
    """Each public name and the module (under this package) it comes from: the imports
    under ``TYPE_CHECKING`` above, read from this file."""
    tree = ast.parse(Path(__file__).read_text(encoding="utf-8"))
    block = next(
        node
        for node in tree.body
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
    )
    return {
        alias.asname or alias.name: str(node.module)
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }


_HOMES = _homes()
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    home = importlib.import_module(f"{__name__}.{_HOMES[name]}")
    # a name its module lacks is a module of that package (``device``): loaded as one
    value = getattr(home, name) if hasattr(home, name) else importlib.import_module(f"{home.__name__}.{name}")
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
