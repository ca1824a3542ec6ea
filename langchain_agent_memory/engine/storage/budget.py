"""Bounded cache storage: a byte budget and/or a time to live for stored agent caches,
enforced by evicting agents least recently used first.

An agent's record and the blocks only it names go together (blocks shared with agents that
stay, stay); a LangGraph snapshot (``@snapshot:...``) is an agent like any other here, so
an evicted one leaves its checkpoint in place and a thread resumed from it prefills. What
counts: every block file the store's records name, the index (with its journal) and
quarantined files (moved aside as corrupt: the first to go). Agents a request is using
(``in_use``) and saves not yet uploaded to a shared store are never evicted.
"""

from __future__ import annotations

import logging
import re
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

from .blocks import BlockHash
from .protocols import BlockStore

logger = logging.getLogger(__name__)

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "kib": 1 << 10,
    "m": 10**6, "mb": 10**6, "mib": 1 << 20,
    "g": 10**9, "gb": 10**9, "gib": 1 << 30,
    "t": 10**12, "tb": 10**12, "tib": 1 << 40,
}  # fmt: skip
_AGE_UNITS = {"s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_NUMBER = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | float | str) -> int:
    """Bytes from ``5GB``, ``512MiB``, ``1.5g`` or a number (decimal units: GB = 10^9;
    binary with an ``i``: GiB = 2^30)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"a size cannot be negative: {value}")
        return int(value)
    m = _NUMBER.match(str(value))
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _SIZE_UNITS:
        raise ValueError(f"not a size: {value!r} (write e.g. 5GB, 500MB, 2GiB or a number of bytes)")
    return int(float(m.group(1)) * _SIZE_UNITS[unit])


def parse_age(value: float | int | str | timedelta) -> float:
    """Seconds from ``7d``, ``12h``, ``30m``, ``2w``, ``45s``, a ``timedelta`` or a number of
    seconds."""
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    else:
        m = _NUMBER.match(str(value))
        unit = m.group(2).lower() if m else ""
        if m is None or (unit and unit not in _AGE_UNITS):
            raise ValueError(f"not a duration: {value!r} (write e.g. 7d, 12h, 30m, 2w or seconds)")
        seconds = float(m.group(1)) * _AGE_UNITS.get(unit, 1)
    if seconds <= 0:
        raise ValueError(f"a time to live must be positive: {value!r}")
    return seconds


@dataclass(frozen=True, slots=True)
class StorageBudget:
    """At most ``max_bytes`` on disk; agents unused for ``ttl_s`` seconds evicted."""

    max_bytes: int | None = None
    ttl_s: float | None = None

    @classmethod
    def of(
        cls, max_disk_bytes: int | str | None = None, ttl: float | str | timedelta | None = None
    ) -> StorageBudget | None:
        """A budget from user values (``parse_size`` / ``parse_age`` forms); None if neither."""
        if max_disk_bytes is None and ttl is None:
            return None
        return cls(
            None if max_disk_bytes is None else parse_size(max_disk_bytes),
            None if ttl is None else parse_age(ttl),
        )

    def __str__(self) -> str:
        parts = [f"{self.max_bytes} bytes" if self.max_bytes is not None else "",
                 f"ttl {self.ttl_s:g} s" if self.ttl_s is not None else ""]  # fmt: skip
        return ", ".join(p for p in parts if p) or "unbounded"


@dataclass(slots=True)
class EvictionReport:
    bytes_before: int = 0
    bytes_after: int = 0
    #: (store fingerprint, agent id) of each evicted agent, in eviction order.
    evicted: list[tuple[str, str]] = field(default_factory=list)
    expired: int = 0  # of them, evicted for the time to live
    quarantine_bytes: int = 0  # quarantined files removed
    #: Blocks deleted, per store fingerprint (a pool forgets its memory copies of them).
    deleted_blocks: dict[str, list[BlockHash]] = field(default_factory=dict)
    #: Still over the budget: what is left is in use (or not yet uploaded).
    over_budget: bool = False


def enforce(
    stores: Sequence[BlockStore],
    budget: StorageBudget,
    *,
    in_use: Callable[[str, str], bool] = lambda fp, agent: False,
    now: float | None = None,
    low_water: float = 1.0,
    dry_run: bool = False,
) -> EvictionReport:
    """Bring ``stores`` (together) within ``budget``: first agents unused for longer than
    its time to live, then, when over the byte budget, quarantined files and agents least
    recently used first (across the stores) until the bytes fit ``low_water`` of it (an
    engine leaves headroom, so that a pass runs every few saves, not after each).
    ``in_use(fingerprint, agent_id)``: never evicted. ``dry_run``: plan only (the report
    says what would go). Callers hold each store's lock when other threads may write."""
    usages = [s.maintenance.usage() for s in stores]
    report = EvictionReport(bytes_before=sum(u.total for u in usages))
    # How many records name each block: a block's bytes are freed when the last goes.
    holders = {u.fingerprint: Counter(h for blocks in u.refs.values() for h in blocks) for u in usages}
    candidates = sorted(
        ((used, u.fingerprint, agent) for u in usages for agent, used in u.agents),
        key=lambda c: (c[0], c[1], c[2]),
    )
    total = report.bytes_before
    chosen: dict[str, list[str]] = {}
    cutoff = None if budget.ttl_s is None else (now if now is not None else time.time()) - budget.ttl_s

    def take(fp: str, agent: str) -> None:
        nonlocal total
        usage = next(u for u in usages if u.fingerprint == fp)
        for h in usage.refs.get(agent, ()):
            holders[fp][h] -= 1
            if holders[fp][h] == 0:
                total -= usage.sizes.get(h, 0)
        chosen.setdefault(fp, []).append(agent)
        report.evicted.append((fp, agent))

    pinned = {s.fingerprint: s.replication.pinned() if s.replication else set() for s in stores}
    left = []
    for used, fp, agent in candidates:
        if in_use(fp, agent) or agent in pinned[fp]:
            continue
        if cutoff is not None and used < cutoff:
            take(fp, agent)
            report.expired += 1
        else:
            left.append((fp, agent))
    if budget.max_bytes is not None and total > budget.max_bytes:
        report.quarantine_bytes = sum(u.quarantine_bytes for u in usages)
        total -= report.quarantine_bytes
        goal = int(budget.max_bytes * low_water)
        for fp, agent in left:
            if total <= goal:
                break
            take(fp, agent)
    report.over_budget = budget.max_bytes is not None and total > budget.max_bytes
    if dry_run:
        report.bytes_after = total
        return report
    for store in stores:
        if report.quarantine_bytes:
            store.maintenance.clear_quarantine()
        agents = chosen.get(store.fingerprint)
        if agents:
            _, deleted = store.maintenance.evict_agents(agents)
            report.deleted_blocks[store.fingerprint] = deleted
    report.bytes_after = sum(s.maintenance.disk_bytes() for s in stores)
    if report.evicted:
        names = [agent for _, agent in report.evicted]
        logger.info(
            "cache budget (%s): evicted %d agent cache(s) least recently used first (%d expired), "
            "%d -> %d bytes: %s%s",
            budget, len(names), report.expired, report.bytes_before, report.bytes_after,
            ", ".join(names[:20]), " ..." if len(names) > 20 else "",
        )  # fmt: skip
    return report


@dataclass(slots=True)
class DiskWatch:
    """When an engine looks at its disk use: before the first save, when what it saved since
    its last look may have crossed the byte budget, and every ``recheck_s`` (other processes
    write to the directory too; agents age past the time to live)."""

    budget: StorageBudget
    recheck_s: float = 30.0
    #: What a save may add to the index beyond the bytes it reports (pages of the record,
    #: its references and sizes in SQLite's journal): counted until the next look.
    index_margin: int = 64 << 10
    known: int | None = None  # bytes at the last look
    then: tuple[int, int] = (0, 0)  # (bytes written, saves) by the engine at the last look
    looked_at: float = float("-inf")

    def due(self, written: int, saves: int, now: float) -> bool:
        ttl = self.budget.ttl_s
        interval = self.recheck_s if ttl is None else min(self.recheck_s, ttl / 10)
        if self.known is None or now - self.looked_at >= interval:
            return True
        grown = written - self.then[0] + (saves - self.then[1]) * self.index_margin
        cap = self.budget.max_bytes
        return cap is not None and self.known + grown > cap

    def looked(self, total: int, written: int, saves: int, now: float) -> None:
        self.known, self.then, self.looked_at = total, (written, saves), now


#: Over its byte budget, an engine evicts down to this share of it (headroom for the next
#: saves: an eviction pass then runs every few saves, not after each).
LOW_WATER = 0.9


class BudgetKeeper:
    """Keeps one engine's store within its ``StorageBudget``: after every save (on the save
    thread) when ``DiskWatch`` says a save may have crossed it, or now and then; never
    evicting what ``in_use()`` names (the requests in flight, the agents with saves queued).
    ``evict(budget, in_use, low_water)`` does the eviction (``AgentCaches.evict``: the store
    and the live caches); ``written()`` is the bytes the engine has written so far."""

    def __init__(
        self,
        store: BlockStore,
        evict: Callable[[StorageBudget, set[str], float], EvictionReport],
        in_use: Callable[[], set[str]],
        written: Callable[[], int],
    ) -> None:
        self._store, self._evict, self._in_use, self._written = store, evict, in_use, written
        self._watch: DiskWatch | None = None
        self._said_over = False
        self._evicted: deque[str] = deque(maxlen=100)  # the latest evicted agents, oldest first
        self._evicted_count = 0
        self._saves = 0  # saves so far (a save's index growth counts until the next look)

    @property
    def budget(self) -> StorageBudget | None:
        return self._watch.budget if self._watch else None

    @budget.setter
    def budget(self, budget: StorageBudget | None) -> None:
        self._watch = DiskWatch(budget) if budget is not None else None

    def saved(self) -> None:
        """A save was stored (on the save thread): keep the budget if it may be crossed."""
        self._saves += 1
        if self._watch is not None:
            try:
                self.keep()
            except Exception:  # the save stands; the budget is kept at the next one
                logger.exception("keeping the cache within its disk budget failed")

    def keep(self, force: bool = False) -> EvictionReport | None:
        """Evict what the budget says must go; looks at the disk only when due (or ``force``:
        now, down to the budget itself rather than ``LOW_WATER`` of it)."""
        watch, written, now, saves = self._watch, self._written(), time.time(), self._saves
        if watch is None or not (force or watch.due(written, saves, now)):
            return None
        budget = watch.budget
        total, oldest = self._store.maintenance.disk_bytes(), self._store.maintenance.oldest_use()
        expired = budget.ttl_s is not None and oldest is not None and oldest < now - budget.ttl_s
        report = None
        if expired or (budget.max_bytes is not None and total > budget.max_bytes):
            report = self._evict(budget, self._in_use(), 1.0 if force else LOW_WATER)
            total = report.bytes_after
            self._evicted.extend(agent for _, agent in report.evicted)
            self._evicted_count += len(report.evicted)
            if report.over_budget and not self._said_over:
                self._said_over = True
                logger.warning(
                    "cache budget %s cannot be met: the agents in use (or saves not yet uploaded) "
                    "hold %d bytes; it is kept again once they finish",
                    budget, total,
                )  # fmt: skip
        watch.looked(total, written, saves, now)
        return report

    def stats(self) -> dict[str, object] | None:
        if self._watch is None:
            return None
        return {
            "max_bytes": self._watch.budget.max_bytes,
            "ttl_s": self._watch.budget.ttl_s,
            "bytes": self._watch.known,  # at the last look (``Engine.disk_bytes()``: now)
            "evicted_agents": self._evicted_count,
            "recently_evicted": list(self._evicted),  # the latest 100, oldest first
        }
