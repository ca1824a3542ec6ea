"""Persistent storage of KV blocks and agent records.

Layout under the root directory, one subfolder per model fingerprint (caches of different
models, or of other KV quantizations, never mix)::

    <root>/<fingerprint>/format.json                  {"format_version": 1, "fingerprint": ...}
    <root>/<fingerprint>/blocks/<h[:2]>/<h>.safetensors
    <root>/<fingerprint>/index.sqlite                 agent records and their block references
    <root>/<fingerprint>/lock                         the directory lock (flock) for mutations
    <root>/<fingerprint>/quarantine/                  bad block files, moved aside for inspection

A block file holds the KV tensors of up to 256 tokens for every layer, named
``L{layer}.{k|v}.{q|scales|biases}`` (quantized) or ``L{layer}.{k|v}`` (16-bit), and a
header with the format version, fingerprint, parent hash, token ids and a SHA-256 of the
tensor bytes. Blocks are content-addressed (``block_hash``) and immutable: writing one
that exists is a no-op. Every write is atomic (temp file, fsync, rename, fsync of the
directory; SQLite transactions for the index): a crash leaves the old file or the new
one, never a torn one, and a record is written only after all of its blocks.

Agent ids are keys in the index, never paths, so no id can name a file; ids are still
validated (``validate_agent_id``) so that mistakes surface early. Several processes may
share a directory: mutations run under its lock (``DiskBlockStore.locked``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Iterable, Iterator, Sequence
from pathlib import Path

from ..ops.files import DirectoryLock, atomic_write_bytes
from .block_files import BlockFiles
from .blocks import FORMAT_VERSION, AgentRecord, Block, BlockHash, CacheFormatError, version_error
from .index import AgentIndex, RecoveryReport
from .maintenance import DiskMaintenance
from .reader import BlockGroup


class DiskBlockStore:
    """Blocks as safetensors files (``files``), agent records in a SQLite index (``index``),
    under one directory; its upkeep (disk use, eviction, quarantine, recovery) is
    ``maintenance``'s. On open, its ``recover`` undoes what a killed process may have left:
    temporary files, and blocks written for a record it never committed (or left behind by
    a delete it did not finish).
    """

    #: none: one directory has one writer at a time, so no lease, version or upload
    #: (a shared store's ``SharedReplication``)
    replication: None = None

    def __init__(
        self, root: str | os.PathLike[str], fingerprint: str, *, tier: bool = False, read_only: bool = False
    ) -> None:
        #: The local tier of a shared store: its records may name blocks not fetched yet.
        self.tier = tier
        self.fingerprint = fingerprint
        self.dir = Path(root) / fingerprint
        self.files = BlockFiles(self.dir, fingerprint)
        self.blocks_dir = self.files.dir
        self._lock = DirectoryLock(self.dir / "lock")  # never taken by a read-only store
        if read_only:  # for looking (``cache ls``/``du``): no lock, no migration, no recovery
            self._open_read_only()
            return
        self.blocks_dir.mkdir(parents=True, exist_ok=True)
        with self._lock:
            fmt = self.dir / "format.json"
            if fmt.exists():
                try:
                    version = json.loads(fmt.read_text()).get("format_version")
                except (ValueError, AttributeError) as exc:  # bad JSON or UTF-8, not an object
                    raise CacheFormatError(
                        f"{fmt} is corrupt ({exc}); move the directory {self.dir} aside to start afresh"
                    ) from exc
                if version != FORMAT_VERSION:
                    raise version_error(f"cache directory {self.dir}", version)
            else:
                meta = {"format_version": FORMAT_VERSION, "fingerprint": fingerprint}
                atomic_write_bytes(fmt, json.dumps(meta).encode())
            self.index = AgentIndex.open(self.dir / "index.sqlite", self.files)
            self.maintenance = DiskMaintenance(self.dir, self.files, self.index, self._lock, tier=tier)
            self.recovery = self.maintenance.recover()

    def _open_read_only(self) -> None:
        """Open an existing directory without changing anything in it: its index read-only
        (a write raises ``sqlite3.OperationalError``), no recovery (``recovery`` is empty)."""
        fmt = self.dir / "format.json"
        try:
            version = json.loads(fmt.read_text()).get("format_version")
        except (OSError, ValueError, AttributeError) as exc:
            raise CacheFormatError(f"{self.dir} is not a readable cache directory ({exc})") from exc
        if version != FORMAT_VERSION:
            raise version_error(f"cache directory {self.dir}", version)
        self.index = AgentIndex.open_read_only(self.dir / "index.sqlite", self.files)
        self.maintenance = DiskMaintenance(self.dir, self.files, self.index, self._lock, tier=self.tier)
        self.recovery = RecoveryReport()

    def locked(self) -> DirectoryLock:
        """Hold the directory's exclusive lock (re-entrant in this thread)."""
        return self._lock

    def leading_blocks(self, hashes: Sequence[BlockHash]) -> int:
        """How many of ``hashes``, from the first, are here."""
        return next((i for i, h in enumerate(hashes) if not self.has_block(h)), len(hashes))

    @property
    def local(self) -> DiskBlockStore:
        """This worker's directory (a shared store's local tier): a local store is its own."""
        return self

    def local_tier(self) -> DiskBlockStore:
        """What the engine's model thread reads (``local_tier``): all of this store, which
        never waits on a network."""
        return self

    def close(self) -> None:
        self.index.close()

    # ------------------------------------------------------------------ blocks (``files``)

    def block_path(self, h: BlockHash) -> Path:
        return self.files.path(h)

    def has_block(self, h: BlockHash) -> bool:
        return self.files.exists(h)

    def local_bytes(self, hashes: Iterable[BlockHash]) -> int:
        return self.files.local_bytes(hashes)

    def put_block(self, block: Block) -> int:
        return self.files.put(block)

    def prior_of(self, h: BlockHash) -> BlockHash | None:
        """The block of segment ``h``'s earlier rows (None: whole); ``h`` must be here."""
        return self.files.prior_of(h)

    def get_block(self, h: BlockHash, names: Sequence[str] | None = None) -> Block:
        return self.files.get(h, names)

    def read_blocks(
        self, hashes: Sequence[BlockHash], layers: Collection[int] | None = None
    ) -> list[BlockGroup]:
        return self.files.read(hashes, layers)

    def delete_block(self, h: BlockHash) -> None:
        self.files.delete(h)

    def block_hashes(self) -> Iterator[BlockHash]:
        return self.files.hashes()

    def quarantine_block(self, h: BlockHash) -> Path | None:
        return self.files.quarantine(h)

    # ------------------------------------------------------------------ agents (``index``)

    def put_agent(self, record: AgentRecord, sync: tuple[int | None, bool] | None = None) -> int:
        return self.index.put_agent(record, sync)

    def sync_state(self, agent_id: str) -> tuple[int | None, bool] | None:
        return self.index.sync_state(agent_id)

    def set_sync(self, agent_id: str, version: int | None, pending: bool) -> None:
        self.index.set_sync(agent_id, version, pending)

    def pending_agents(self) -> list[str]:
        return self.index.pending_agents()

    def upload_pending(self, agent_id: str) -> bool:
        return self.index.upload_pending(agent_id)

    def has_agent(self, agent_id: str) -> bool:
        return self.index.has_agent(agent_id)

    def agent_chain(self, agent_id: str) -> list[BlockHash]:
        return self.index.agent_chain(agent_id)

    def get_agent(self, agent_id: str) -> AgentRecord | None:
        return self.index.get_agent(agent_id)

    def delete_agent(self, agent_id: str) -> bool:
        return self.index.delete_agent(agent_id)

    def agents(self, prefix: str = "", *, warn: bool = True) -> Iterator[AgentRecord]:
        return self.index.agents(prefix, warn=warn)

    def is_referenced(self, h: BlockHash) -> bool:
        return self.index.is_referenced(h)

    def refcount(self, h: BlockHash) -> int:
        return self.index.refcount(h)

    def referenced_blocks(self) -> set[BlockHash]:
        return self.index.referenced_blocks()

    def note_blocks(self, blocks: Sequence[BlockHash]) -> None:
        self.index.note_blocks(blocks)
