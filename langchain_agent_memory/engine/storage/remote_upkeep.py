"""The upkeep side of ``SharedBlockStore`` (it holds ``SharedUpkeep`` as ``upkeep``):
garbage collection of block objects no record names, and ``verify``, which checks every
block the catalog says is stored against the object store and repairs what it finds
missing."""

from __future__ import annotations

from dataclasses import dataclass

from .blocks import BlockHash
from .catalog import Catalog
from .objects import ObjectBlocks
from .remote_blocks import SharedBlocks
from .store import DiskBlockStore


@dataclass(slots=True)
class VerifyReport:
    checked: int = 0  # blocks the catalog says are stored
    missing: int = 0  # of those, without an object
    uploaded: int = 0  # repaired from this worker's copy
    marked_missing: int = 0  # repaired in the catalog (no copy here)
    dangling: int = 0  # references to blocks not stored, after the repair


@dataclass(slots=True)
class GarbageReport:
    blocks_collected: int = 0
    stray_objects_removed: int = 0  # objects with no catalog row (an upload cut short)


class SharedUpkeep:
    """Upkeep of a shared store's blocks: objects in ``objects``, rows in ``catalog``;
    ``blocks`` uploads this worker's copies (``local``) of those found missing."""

    def __init__(
        self,
        local: DiskBlockStore,
        catalog: Catalog,
        objects: ObjectBlocks,
        blocks: SharedBlocks,
        *,
        grace_s: float,
    ) -> None:
        self.local, self.catalog, self.objects, self.blocks = local, catalog, objects, blocks
        self.fingerprint = local.fingerprint
        self.grace_s = grace_s

    def collect_garbage(self, grace_s: float | None = None) -> GarbageReport:
        """Delete block objects no record names, untouched for ``grace_s`` (default: the
        store's), each under its catalog row lock; then objects without a catalog row
        older than the grace period (uploads cut short)."""
        grace = self.grace_s if grace_s is None else grace_s
        report = GarbageReport()
        for h in self.catalog.collectable(self.fingerprint, grace):
            key = self.objects.key(self.fingerprint, BlockHash(h))
            if self.catalog.collect(self.fingerprint, h, grace, lambda key=key: self.objects.delete(key)):
                report.blocks_collected += 1
        now = self.catalog.now()
        known = self.catalog.cataloged(self.fingerprint)
        for info in self.objects.list(self.fingerprint):
            h = self.objects.hash_of(info.key)
            if h is not None and h not in known and info.last_modified.timestamp() < now - grace:
                self.objects.delete(info.key)
                report.stray_objects_removed += 1
        return report

    def verify(self, repair: bool = True) -> VerifyReport:
        """Check every block the catalog says is stored against the object store; with
        ``repair``, upload the missing ones this worker has on disk and mark the others
        missing (a record naming one then prefills, and its next save uploads it)."""
        report = VerifyReport()
        present = {self.objects.hash_of(o.key) for o in self.objects.list(self.fingerprint)}
        for h in sorted(self.catalog.stored_blocks(self.fingerprint)):
            report.checked += 1
            # Listed before the rows were read: a block uploaded in between is stored and
            # not listed; it is looked up alone (a row is marked stored after its upload).
            if h in present or self.objects.exists(self.objects.key(self.fingerprint, BlockHash(h))):
                continue
            report.missing += 1
            if not repair:
                continue
            if self.local.blocks.has(BlockHash(h)):
                self.blocks.upload([BlockHash(h)], check=False)
                report.uploaded += 1
            else:
                self.catalog.unstore(self.fingerprint, [h])
                report.marked_missing += 1
        report.dangling = self.catalog.dangling(self.fingerprint)
        return report
