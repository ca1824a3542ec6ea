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

A store is its roles, which callers use directly (``protocols.BlockStore``): here
``blocks`` is the ``BlockFiles`` and ``records`` the ``AgentIndex`` of the directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..ops.files import DirectoryLock, atomic_write_bytes
from .block_files import BlockFiles
from .blocks import FORMAT_VERSION, CacheFormatError, version_error
from .index import AgentIndex, RecoveryReport
from .maintenance import DiskMaintenance


class DiskBlockStore:
    """One cache directory, as its roles (``protocols.BlockStore``): ``blocks``, its block
    files (safetensors, ``BlockFiles``); ``records``, its agent records (a SQLite index,
    ``AgentIndex``); ``maintenance``, its upkeep (disk use, eviction, quarantine, recovery);
    no ``replication``. On open, its ``recover`` undoes what a killed process may have left:
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
        self.blocks = BlockFiles(self.dir, fingerprint)
        self._lock = DirectoryLock(self.dir / "lock")  # never taken by a read-only store
        if read_only:  # for looking (``cache ls``/``du``): no lock, no migration, no recovery
            self._open_read_only()
            return
        self.blocks.dir.mkdir(parents=True, exist_ok=True)
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
            self.records = AgentIndex.open(self.dir / "index.sqlite", self.blocks)
            self.maintenance = DiskMaintenance(self.dir, self.blocks, self.records, self._lock, tier=tier)
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
        self.records = AgentIndex.open_read_only(self.dir / "index.sqlite", self.blocks)
        self.maintenance = DiskMaintenance(self.dir, self.blocks, self.records, self._lock, tier=self.tier)
        self.recovery = RecoveryReport()

    def locked(self) -> DirectoryLock:
        """Hold the directory's exclusive lock (re-entrant in this thread)."""
        return self._lock

    @property
    def local(self) -> DiskBlockStore:
        """This worker's directory (a shared store's local tier): a local store is its own."""
        return self

    def local_tier(self) -> DiskBlockStore:
        """What the engine's model thread reads (``local_tier``): all of this store, which
        never waits on a network."""
        return self

    def close(self) -> None:
        """Close the index (the one thing a directory holds open)."""
        self.records.close()
