"""What the engine asks of a block store (``DiskBlockStore``, ``SharedStore``), in three
narrow protocols: ``BlockStoreBlocks`` (block files), ``BlockStoreRecords`` (agent records
and the leases around a request), ``BlockStoreMaintenance`` (bytes on disk, eviction,
quarantine). ``BlockStore`` is all three: what a backend implements, and what the store
conformance suite (tests/integration/test_store_conformance.py) checks on every backend."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Collection, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Protocol

from .blocks import AgentRecord, Block, BlockHash, StoreUsage
from .reader import BlockGroup
from .status import StoreStatus

logger = logging.getLogger(__name__)


class BlockStoreBlocks(Protocol):
    """Block files: content-addressed, immutable, written before any record names them."""

    fingerprint: str

    def has_block(self, h: BlockHash) -> bool: ...
    def has_local_block(self, h: BlockHash) -> bool: ...
    def local_bytes(self, hashes: Iterable[BlockHash]) -> int: ...
    def put_block(self, block: Block) -> int: ...
    def get_block(self, h: BlockHash, names: Sequence[str] | None = None) -> Block: ...
    def read_blocks(
        self, hashes: Sequence[BlockHash], layers: Collection[int] | None = None
    ) -> list[BlockGroup]: ...
    def delete_block(self, h: BlockHash) -> None: ...
    def block_hashes(self) -> Iterator[BlockHash]: ...
    def is_referenced(self, h: BlockHash) -> bool: ...


class BlockStoreRecords(Protocol):
    """Agent records, and the lease around a request (a shared store's: ``begin`` says
    whether a live copy at ``version`` is current; ``end`` gives the lease back without a
    commit; ``put_agent`` commits and gives it back)."""

    def put_agent(self, record: AgentRecord) -> int: ...
    def get_agent(self, agent_id: str) -> AgentRecord | None: ...
    def has_agent(self, agent_id: str) -> bool: ...
    def upload_pending(self, agent_id: str) -> bool: ...
    def agent_chain(self, agent_id: str) -> list[BlockHash]: ...
    def delete_agent(self, agent_id: str) -> bool: ...
    def agents(self, prefix: str = "") -> Iterator[AgentRecord]: ...
    def begin(self, agent_id: str, version: int | None) -> bool: ...
    def seen_version(self, agent_id: str) -> int | None: ...
    def end(self, agent_id: str) -> None: ...


class BlockStoreMaintenance(Protocol):
    """Bytes on disk, eviction, quarantine; mutations that must not interleave with another
    process's (a commit: blocks then record; a delete: record then orphaned blocks) run
    inside ``with store.locked():``."""

    def locked(self) -> contextlib.AbstractContextManager[None]: ...
    def disk_bytes(self) -> int: ...
    def oldest_use(self) -> float | None: ...
    def usage(self) -> StoreUsage: ...
    def pinned(self) -> set[str]: ...
    def evict_agents(self, agent_ids: Sequence[str]) -> tuple[int, list[BlockHash]]: ...
    def quarantine_block(self, h: BlockHash) -> Path | None: ...
    def quarantine_agent(self, agent_id: str) -> Path | None: ...
    def clear_quarantine(self) -> int: ...
    def status(self) -> StoreStatus: ...
    def bound_pending(self, max_bytes: int | None) -> None: ...
    def close(self) -> None: ...


class BlockStore(BlockStoreBlocks, BlockStoreRecords, BlockStoreMaintenance, Protocol):
    """A backend: all three (local ``DiskBlockStore``, ``remote.SharedStore``); both pass
    the store conformance suite (tests/integration/test_store_conformance.py)."""


class Lease:
    """A request's hold on an agent (``take_lease``): ``current`` says whether a live copy at
    the version the caller holds is the newest. Given back exactly once: by ``release`` (a
    request that ends without a commit), or by the commit that ends it (``committed``: the
    store's ``put_agent`` gives it back). As a context manager it is given back when its
    block raises. A local store's lease holds nothing; a shared store's is a row in its
    catalog that other workers' requests wait on until it is given back or expires."""

    __slots__ = ("_done", "agent_id", "current", "store")

    def __init__(self, store: BlockStoreRecords, agent_id: str, current: bool) -> None:
        self.store, self.agent_id, self.current = store, agent_id, current
        self._done = False

    def release(self) -> None:
        if not self._done:
            self._done = True
            self.store.end(self.agent_id)

    def committed(self) -> None:
        self._done = True

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        if kind is not None:
            self.release()


def take_lease(store: BlockStoreRecords, agent_id: str, version: int | None) -> Lease:
    """Take the agent's lease in ``store`` for a request that holds it at ``version``."""
    return Lease(store, agent_id, store.begin(agent_id, version))
