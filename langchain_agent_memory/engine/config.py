"""An engine's settings, resolved once: what the caller gave, else the environment's
(``AGENT_MEMORY_*``, ``config.Settings``), else the device's defaults (``device``). The one
place below the settings that reads them: the chat model, the checkpointer, the server and
the command line each build an ``EngineConfig`` and hand it down; the engine's parts read
only what it says."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from ..config import get_settings
from .kv import KVQuant
from .kv import kv_format as kv_format_of
from .model import loading
from .model.loading import LoadedModel
from .ops import device
from .requests.scheduler import POLICIES
from .storage.budget import StorageBudget
from .storage.store_config import StoreConfig

#: which shared engine a config names (``EngineConfig.key``): model directory, cache
#: directory, KV format, shared store's records and blocks
EngineKey = tuple[Path, Path, str, str | None, str | None]


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How an ``Engine`` runs.

    ``model``: a shipped name, an mlx-lm directory of a supported family or a ``.gguf``
    (None: ``AGENT_MEMORY_MODEL``). ``quant``: the KV format (``kv_bits`` 4, 8 or None =
    16-bit, or ``kv_format``, a ``KV_PRESETS`` name, which wins). Budgets: the pool's memory
    tier (``hot_budget_bytes``), live agents (``hot_agents``), their full-precision working
    copies (``work_budget_bytes``); ``chunk_tokens``: the prefill chunk (``alone_chunk_tokens``
    when a request runs alone; a chunk given is used for both). ``attention``: what a
    request attends over, ``"stored"`` (the agent's stored form and the request's own
    tokens: no full-precision copy of the context, ``kv.stored``) or ``"copy"`` (a
    full-precision working copy, kept for the most recent agents within
    ``work_budget_bytes``); default: ``AGENT_MEMORY_ATTENTION``, else stored on a GPU, copy on
    the CPU. ``cpu_kernels=False`` runs mlx-lm's own attention on arrays the engine's caches
    return (tests, benchmarks). ``share_prefixes``: requests in flight together whose prompts
    start alike (a fan-out) prefill the common part once (``forks``). ``store`` (a
    ``postgresql://`` URL) and ``blocks`` (an ``s3://`` URL): caches shared by workers on
    several hosts, ``cache_dir`` the local tier in front (``storage.remote``); checked at
    start (a wrong one fails with its cause) unless ``lazy_store`` (default the settings'):
    ``store`` holds them (``StoreConfig``), None without one.
    ``storage_budget``: what the store keeps on disk (``max_disk_bytes``: ``5GB``, ``500MiB``
    or bytes; ``cache_ttl``: ``7d``, ``12h``, seconds or a ``timedelta``): agents least
    recently used (and unused for longer than the TTL) are evicted, never one in use; with
    a shared store it bounds this worker's local tier. ``reserve_work`` (CPU): touch, at
    start, the working-copy memory of one agent at ``context_length``, as llama.cpp's context
    clears its KV buffer, so that a warm restore does not pay for fresh pages (``kv.reserve``).
    ``context_length`` None: the model's trained context. ``state_budget`` (hybrid models):
    an agent's recurrent-state snapshots take at most this many times its K/V's bytes on disk
    (beyond the two it always keeps; None: every one the policy picks, ``engine.states``).
    The hot tier: at most ``hot_agents`` agents keep live caches, taking at most ``hot_bytes``
    (defaults: on the CPU 16 agents, no byte bound; on a GPU half its memory, not a count:
    ``ops.device``); which leaves first is decided by when each runs next, as a graph's
    checkpointer tells it (``caches.schedule``), least recently used where nothing was said;
    an agent whose reply made tool calls stays for ``tool_ttl_s`` waiting for their results;
    ``eviction="lru"``: least recently used first, whatever was said.
    """

    cache_dir: Path
    model: str | Path
    #: where converted models (GGUF -> mlx-lm) and model digests are kept: the settings'
    #: cache directory (``AGENT_MEMORY_CACHE_DIR``), shared by every engine of the host
    #: whatever its ``cache_dir`` (a conversion is made once)
    models_dir: Path
    weight_dtype: str
    quant: KVQuant
    hot_budget_bytes: int
    hot_agents: int
    work_budget_bytes: int
    chunk_tokens: int
    alone_chunk_tokens: int
    scheduling: str
    context_length: int | None
    cpu_kernels: bool
    share_prefixes: bool
    store: StoreConfig | None
    storage_budget: StorageBudget | None
    reserve_work: bool
    attention: str
    state_budget: float | None = 1.0
    #: bytes the hot agents' live caches may take (None: only ``hot_agents`` bounds them)
    hot_bytes: int | None = None
    #: seconds an agent whose reply made tool calls stays hot waiting for their results
    tool_ttl_s: float = 30.0
    #: which hot agent leaves first: ``"schedule"`` (by when each runs next, as told; LRU
    #: where nothing was said) or ``"lru"`` (least recently used, whatever is said)
    eviction: str = "schedule"
    #: ``hot_budget_bytes`` was given, not the device's default: a shared engine found again
    #: for this config raises its budget to it (``registry.shared_engine``)
    hot_budget_asked: bool = False

    @property
    def key(self) -> EngineKey:
        """Which of the process's shared engines this config names (``registry``): model
        directory, cache directory, KV format and shared store, not how the store starts
        (``lazy``) nor budgets. Resolving the model converts a GGUF on first use (and hashes
        a GGUF file given by path), like loading it: an engine that has loaded the model
        asks ``key_for`` its directory instead."""
        path, _ = loading.resolve_model_dir(
            self.model, cache_dir=self.models_dir, weight_dtype=self.weight_dtype
        )
        return self.key_for(path)

    def key_for(self, model_dir: Path) -> EngineKey:
        """``key``, the model already resolved to ``model_dir``."""
        store = self.store
        return (model_dir, self.cache_dir.expanduser().resolve(), self.quant.label,
                store.records if store else None, store.blocks if store else None)  # fmt: skip

    def for_model(self, model: str | Path, kv_format: str | KVQuant) -> EngineConfig:
        """This config for another model and KV format (the same directory and store)."""
        return dataclasses.replace(self, model=model, quant=kv_format_of(kv_format))

    @classmethod
    def resolve(
        cls,
        model: str | Path | None = None,
        *,
        cache_dir: str | Path | None = None,
        kv_bits: int | None = 4,
        kv_format: str | KVQuant | None = None,
        hot_budget_bytes: int | None = None,
        hot_agents: int | None = None,
        work_budget_bytes: int | None = None,
        chunk_tokens: int | None = None,
        scheduling: str = "interleave",
        context_length: int | None = None,
        cpu_kernels: bool = True,
        share_prefixes: bool = True,
        store: str | None = None,
        blocks: str | None = None,
        max_disk_bytes: int | str | None = None,
        cache_ttl: float | str | timedelta | None = None,
        reserve_work: bool | None = None,
        attention: str | None = None,
        state_budget: float | None = 1.0,
        hot_bytes: int | None = None,
        tool_ttl_s: float = 30.0,
        eviction: str = "schedule",
        lazy_store: bool | None = None,
        handoff_wait_s: float | None = None,
        weight_dtype: str | None = None,
    ) -> EngineConfig:
        """The ``Engine`` constructor's arguments, every default filled in; a wrong value
        is a ``ValueError`` that names it, before any model is loaded."""
        settings = get_settings()
        chosen = attention or settings.attention or device.attention()
        if chosen not in ("stored", "copy"):
            raise ValueError(f"attention must be 'stored' or 'copy', not {chosen!r}")
        if scheduling not in POLICIES:
            raise ValueError(f"scheduling must be one of {POLICIES}, not {scheduling!r}")
        if state_budget is not None and not state_budget > 0:
            raise ValueError(
                f"state_budget must be a positive multiple of the K/V bytes or None, not {state_budget}"
            )
        if context_length is not None and context_length < 2:
            raise ValueError(f"context_length must be at least 2 tokens, not {context_length}")
        if hot_bytes is not None and hot_bytes < 0:
            raise ValueError(
                f"hot_bytes must be a number of bytes (or None: the device's default), not {hot_bytes}"
            )
        if eviction not in ("schedule", "lru"):
            raise ValueError(f"eviction must be 'schedule' or 'lru', not {eviction!r}")
        if not tool_ttl_s >= 0:
            raise ValueError(f"tool_ttl_s must be seconds (0: no wait for tool results), not {tool_ttl_s}")
        return cls(
            cache_dir=Path(cache_dir or settings.cache_dir),
            model=model or settings.model,
            models_dir=Path(settings.cache_dir),
            weight_dtype=weight_dtype or settings.weight_dtype or device.weight_dtype(),
            quant=kv_format_of(kv_format if kv_format is not None else kv_bits),
            hot_budget_bytes=device.hot_budget_bytes() if hot_budget_bytes is None else hot_budget_bytes,
            hot_agents=device.hot_agents() if hot_agents is None else hot_agents,
            work_budget_bytes=device.work_budget_bytes() if work_budget_bytes is None else work_budget_bytes,
            chunk_tokens=chunk_tokens or device.chunk_tokens(),
            alone_chunk_tokens=chunk_tokens or device.alone_chunk_tokens(),
            scheduling=scheduling,
            context_length=context_length,
            cpu_kernels=cpu_kernels,
            share_prefixes=share_prefixes,
            store=StoreConfig.of(
                store or settings.store,
                blocks or settings.blocks,
                lazy=settings.lazy_store if lazy_store is None else lazy_store,
                handoff_wait_s=settings.handoff_wait_s if handoff_wait_s is None else handoff_wait_s,
            ),
            storage_budget=StorageBudget.of(
                max_disk_bytes if max_disk_bytes is not None else settings.max_disk_bytes,
                cache_ttl if cache_ttl is not None else settings.cache_ttl,
            ),
            reserve_work=settings.reserve_work if reserve_work is None else reserve_work,
            attention=chosen,
            state_budget=state_budget,
            hot_budget_asked=hot_budget_bytes is not None,
            hot_bytes=device.hot_bytes() if hot_bytes is None else hot_bytes,
            tool_ttl_s=tool_ttl_s,
            eviction=eviction,
        )


def resolve_model_dir(
    model: str | Path | None = None,
    *,
    cache_dir: str | Path | None = None,
    weight_dtype: str | None = None,
    revision: str | None = None,
) -> tuple[Path, str]:
    """The mlx-lm directory for ``model`` and its display name (``model.loading``), what is
    not given taken from the settings: ``AGENT_MEMORY_MODEL`` (else ``smollm2-135m``),
    ``AGENT_MEMORY_CACHE_DIR`` for GGUF conversions, ``AGENT_MEMORY_WEIGHT_DTYPE``."""
    settings = get_settings()
    return loading.resolve_model_dir(
        model or settings.model, cache_dir=Path(cache_dir or settings.cache_dir),
        weight_dtype=weight_dtype or settings.weight_dtype, revision=revision,
    )  # fmt: skip


def load_model(
    model: str | Path | None = None,
    *,
    cache_dir: str | Path | None = None,
    weight_dtype: str | None = None,
    cpu_kernels: bool = True,
    self_check: bool = True,
    recheck: bool = False,
) -> LoadedModel:
    """Load (once per process) the mlx-lm model and tokenizer named by ``model``
    (``model.loading.load_model``), what is not given taken from the settings as in
    ``resolve_model_dir``."""
    settings = get_settings()
    return loading.load_model(
        model or settings.model, cache_dir=Path(cache_dir or settings.cache_dir),
        weight_dtype=weight_dtype or settings.weight_dtype, cpu_kernels=cpu_kernels,
        self_check=self_check, recheck=recheck,
    )  # fmt: skip
