"""The stored caches administered without a model (``StoreAdmin``): what ``agent-memory
cache`` does with a cache directory's stores (list, show, delete, prune, collect garbage,
verify and quarantine, disk use), and the shared store's database for the rooms that keep
their own tables there (``database_session``).

This is the one way the rooms above the engine reach storage: they name verbs and the
records and budgets the public API hands out (re-exported here), never a store, catalog,
pool or session class (an import-linter contract in pyproject.toml keeps the facade from
importing ``storage`` directly)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import BlockMissingError, CacheFormatError
from .model.hub import snapshot_repo
from .storage.agent_ids import INTERNAL_PREFIX, is_internal, validate_agent_id
from .storage.block_writes import BlockWrites
from .storage.blocks import AgentRecord, BlockHash
from .storage.budget import StorageBudget, enforce, parse_age, parse_size
from .storage.catalog import Catalog
from .storage.pg_session import POOL_SIZE, PgSession
from .storage.remote import SharedBlockStore, open_store
from .storage.remote_upkeep import VerifyReport
from .storage.store import DiskBlockStore
from .storage.store_config import StoreConfig

__all__ = [
    "INTERNAL_PREFIX",
    "AgentRecord",
    "BlockCheck",
    "DiskUse",
    "ModelStore",
    "PruneReport",
    "StorageBudget",
    "StoreAdmin",
    "database_session",
    "is_internal",
    "parse_age",
    "parse_size",
    "validate_agent_id",
]


@functools.lru_cache(maxsize=256)  # a listing names a store on every row
def model_label(fingerprint: str) -> str:
    """A store's model as people name it: a Hugging Face repo id's caches carry the
    snapshot's commit hash where a shipped model's carry its name (the fingerprint starts
    with the model directory's name), so the repo is looked up in the Hugging Face cache
    and named first; otherwise (or once that snapshot is deleted) the fingerprint alone.

    >>> model_label("smollm2-135m-b179c9523d0e6a0f-float32-v1-k6g64h")
    'smollm2-135m-b179c9523d0e6a0f-float32-v1-k6g64h'
    """
    repo = snapshot_repo(fingerprint[:40]) if fingerprint[40:41] == "-" else None
    return fingerprint if repo is None else f"{repo} ({fingerprint})"


@dataclass(frozen=True, slots=True)
class DiskUse:
    """One model's stored caches on this disk, as a disk budget counts them."""

    agents: int  # agents with a cache (a checkpointer's snapshots not counted)
    blocks: int  # block files agents name
    bytes: int  # those, the index and the quarantine
    quarantined: int  # files set aside as damaged


@dataclass(frozen=True, slots=True)
class BlockCheck:
    """Every block this directory's agents name, read back and its checksums compared."""

    checked: int
    damaged: list[str]  # hashes of blocks that failed (quarantined with ``repair``)
    quarantined: int
    missing: int  # blocks gone already (quarantined before): their agents prefill


@dataclass(frozen=True, slots=True)
class Collected:
    """What ``ModelStore.collect_garbage`` removed."""

    temp_files: int
    orphan_blocks: int
    shared_objects: int  # a shared store's block objects no record names


class ModelStore:
    """One model's stored caches (a store fingerprint's): a local directory, or a shared
    store with this directory as its local tier."""

    def __init__(self, store: DiskBlockStore | SharedBlockStore) -> None:
        self._store = store
        self.fingerprint = store.fingerprint

    @property
    def label(self) -> str:
        """The model as people name it (``model_label``)."""
        return model_label(self.fingerprint)

    @property
    def shared(self) -> bool:
        """Whether this is a shared store (records in PostgreSQL, blocks in S3)."""
        return isinstance(self._store, SharedBlockStore)

    def agents(self, prefix: str = "") -> list[AgentRecord]:
        """The records of the agents whose ids start with ``prefix``."""
        return list(self._store.records.list(prefix))

    def record(self, agent_id: str) -> AgentRecord | None:
        return self._store.records.get(agent_id)

    def has_agent(self, agent_id: str) -> bool:
        return bool(self._store.records.has(agent_id))

    def block_bytes(self, h: str) -> int | None:
        """Bytes of the block's file in this directory (None: not here)."""
        path = self._store.local.blocks.path(BlockHash(h))
        return path.stat().st_size if path.exists() else None

    def delete_agents(self, agent_ids: list[str]) -> int:
        """Delete these agents' caches (blocks other agents name stay); how many were."""
        writes = BlockWrites(self._store)  # no engine here: no memory tier to keep in step
        return sum(writes.delete_agent(agent) for agent in agent_ids)

    def collect_garbage(self, grace_s: float) -> Collected:
        """Temporary files and blocks no agent names (what a killed process left: those of
        the open too); a shared store's block objects no record names for ``grace_s``."""
        report = self._store.maintenance.recover()
        opened = self._store.local.recovery
        objects = 0
        if isinstance(self._store, SharedBlockStore):
            done = self._store.upkeep.collect_garbage(grace_s=grace_s)
            objects = done.blocks_collected + done.stray_objects_removed
        return Collected(
            temp_files=opened.temp_files_removed + report.temp_files_removed,
            orphan_blocks=opened.orphan_blocks_removed + report.orphan_blocks_removed,
            shared_objects=objects,
        )

    def verify_shared(self, repair: bool) -> VerifyReport | None:
        """A shared store: every block the catalog says is stored checked against the
        object store, what is missing repaired (``SharedBlockStore.verify``); None for a
        local store."""
        if not isinstance(self._store, SharedBlockStore):
            return None
        return self._store.upkeep.verify(repair=repair)

    def check_blocks(self, repair: bool, on_damaged: Callable[[str, Exception], None]) -> BlockCheck:
        """Every block agents name read back and checked; ``on_damaged(hash, error)`` for each
        that fails, which ``repair`` quarantines (its agents prefill what it held)."""
        named = sorted(self._store.local.records.referenced_blocks())
        damaged: list[str] = []
        missing = 0
        for h in named:
            try:
                self._store.blocks.read([h])
            except BlockMissingError:
                missing += 1
            except CacheFormatError as exc:
                on_damaged(h, exc)
                damaged.append(h)
        for h in damaged if repair else ():
            self._store.blocks.quarantine(BlockHash(h))
        return BlockCheck(len(named), damaged, len(damaged) if repair else 0, missing)

    def disk_use(self) -> DiskUse:
        usage = self._store.maintenance.usage()
        quarantine = self._store.dir / "quarantine"
        return DiskUse(
            agents=sum(not is_internal(agent) for agent, _ in usage.agents),
            blocks=len(usage.sizes),
            bytes=usage.total,
            quarantined=len(list(quarantine.iterdir())) if quarantine.is_dir() else 0,
        )

    def close(self) -> None:
        self._store.close()


@dataclass(slots=True)
class PruneReport:
    """What ``StoreAdmin.prune`` evicted (or would, in a dry run)."""

    #: (store fingerprint, agent id) of each evicted agent, in eviction order (a
    #: checkpointer's snapshots among them: ``is_internal``)
    evicted: list[tuple[str, str]] = field(default_factory=list)
    expired: int = 0  # of them, evicted for the time to live
    bytes_before: int = 0
    freed: int = 0
    over_budget: bool = False  # still over: what is left is in use or not yet uploaded
    #: the plan evicted every agent and ``confirm_all`` said no: nothing was evicted
    refused: bool = False


class StoreAdmin:
    """A cache directory's stores, one per model fingerprint (``models``): the directories
    under ``{cache_dir}/kv``, or with a shared store (``records``: its PostgreSQL URL,
    ``blocks``: its s3:// URL), every model it holds, this directory its local tier.
    ``read_only``: for looking: a local directory is opened without recovery, lock or
    migration (a shared store is read through a local tier of this directory, which it may
    fill). A context manager: leaving it closes every store."""

    def __init__(
        self,
        cache_dir: Path,
        records: str | None = None,
        blocks: str | None = None,
        *,
        read_only: bool = False,
    ) -> None:
        config = StoreConfig.of(records, blocks)  # one URL alone: ``RemoteConfigError``
        root = Path(cache_dir) / "kv"
        fingerprints = {p.name for p in root.glob("*") if (p / "format.json").exists()}
        if config is not None:
            catalog = Catalog(config.records)
            try:
                fingerprints |= catalog.fingerprints()
            finally:
                catalog.close()
        self.models: list[ModelStore] = []
        try:
            for fp in sorted(fingerprints):
                opened = open_store(root, fp, config, read_only=read_only and config is None)
                self.models.append(ModelStore(opened))
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> StoreAdmin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for one in self.models:
            one.close()
        self.models = []

    def prune(
        self,
        budget: StorageBudget,
        *,
        dry_run: bool = False,
        confirm_all: Callable[[int], bool] | None = None,
    ) -> PruneReport:
        """Evict agents least recently used first until every model's caches together fit
        ``budget`` (``storage.budget.enforce``), each store locked from the plan to the
        deletes (no save of another process lands between). ``confirm_all(n)``: asked when
        the plan evicts every one of the ``n`` agents (a checkpointer's snapshots aside);
        no: nothing is evicted (``refused``)."""
        stores = [one._store for one in self.models]
        with contextlib.ExitStack() as locks:
            for store in stores:
                locks.enter_context(store.locked())
            usages = {store.fingerprint: store.maintenance.usage() for store in stores}
            plan = enforce(stores, budget, dry_run=True)
            # NOTE: what a prune frees is the block files no agent left names and the
            # quarantine: the plan's figure, and the real one's from the same sizes. The disk
            # after differs by the index's journal, which the deletes grow (a dry run said
            # 6.7 MB, the prune 6.8).
            report = PruneReport(
                evicted=plan.evicted,
                expired=plan.expired,
                bytes_before=plan.bytes_before,
                freed=plan.bytes_before - plan.bytes_after,
                over_budget=plan.over_budget,
            )
            if dry_run:
                return report
            planned = sum(not is_internal(agent) for _, agent in plan.evicted)
            every = sum(not is_internal(agent) for usage in usages.values() for agent, _ in usage.agents)
            if planned and planned == every and confirm_all is not None and not confirm_all(every):
                report.refused = True
                return report
            done = enforce(stores, budget)
            freed = done.quarantine_bytes + sum(
                usages[fp].sizes.get(h, 0) for fp, deleted in done.deleted_blocks.items() for h in deleted
            )
            return PruneReport(
                evicted=done.evicted,
                expired=done.expired,
                bytes_before=done.bytes_before,
                freed=freed,
                over_budget=done.over_budget,
            )


def database_session(
    url: str,
    *,
    setup: Callable[[Any], None] | None = None,
    timeout_s: float = 5.0,
    pool_size: int = POOL_SIZE,
) -> PgSession:
    """A session with a shared store's PostgreSQL database (``postgresql://``) for a room's
    own tables (a checkpointer's links, the server's stored responses), as the store's own
    are kept: each call has a deadline the client keeps, and while the database is out of
    reach calls fail at once with ``RemoteUnavailableError``. ``setup(connection)`` runs
    on each new connection (create the tables)."""
    return PgSession(url, timeout_s=timeout_s, pool_size=pool_size, setup=setup)
