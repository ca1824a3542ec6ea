"""The dashboard's figures over time (``GET /dashboard/history``): per served model, fixed
buckets of ``step_s`` seconds, each holding its replies' time to first token by cache outcome,
their count by source (hot / warm / cold), the prompt tokens reused and prefilled, and the
disk's bytes against its budget as last sampled.

Bounded: ``max_buckets`` per model (an hour of 10-second buckets by default), the oldest
dropped; a bucket's size is fixed (at most 16 outcomes, 3 sources). Prometheus keeps the
long history (``GET /metrics``); this is what a page opened now can draw without one.

>>> h = History(step_s=10, max_buckets=3, clock=lambda: 105.0)
>>> h.reply("m", "hot-extend", ttft_s=0.02, reused=90, prefilled=10)
>>> h.disk("m", 4096, None)
>>> [(b["start"], b["sources"], b["reused"], b["disk_bytes"]) for b in h.since(0)["m"]]
[(100.0, {'hot': 1}, 90, 4096)]
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: An hour of 10-second buckets per model.
STEP_S = 10.0
MAX_BUCKETS = 360


@dataclass(slots=True)
class _Bucket:
    start: float
    #: outcome (``hot-extend``, ``cold``, ...) -> [replies, their summed TTFT, the slowest]
    ttft: dict[str, list[float]] = field(default_factory=dict)
    sources: dict[str, int] = field(default_factory=dict)
    reused: int = 0
    prefilled: int = 0
    disk_bytes: int | None = None
    disk_budget_bytes: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "start": self.start,
            "ttft": {k: {"n": int(n), "mean_s": s / n, "max_s": m} for k, (n, s, m) in self.ttft.items()},
            "sources": dict(self.sources),
            "reused": self.reused,
            "prefilled": self.prefilled,
            "disk_bytes": self.disk_bytes,
            "disk_budget_bytes": self.disk_budget_bytes,
        }


class History:
    """Per model, the last ``max_buckets`` buckets of ``step_s`` seconds (see the module
    docstring). Thread-safe: replies end on the engine's threads, samples and reads come
    from the server's."""

    def __init__(
        self, step_s: float = STEP_S, max_buckets: int = MAX_BUCKETS, clock: Callable[[], float] = time.time
    ) -> None:
        if step_s <= 0 or max_buckets < 1:
            raise ValueError(f"a history needs step_s > 0 and max_buckets >= 1, not {step_s}, {max_buckets}")
        self.step_s, self.max_buckets, self._clock = step_s, max_buckets, clock
        self._models: dict[str, deque[_Bucket]] = {}
        self._lock = threading.Lock()

    def reply(self, model: str, outcome: str, *, ttft_s: float, reused: int, prefilled: int) -> None:
        """One reply ended; ``outcome`` as replies report it (``hot-extend``, ``cold``, ...)."""
        source = outcome.partition("-")[0]
        with self._lock:
            b = self._current(model)
            n, total, slowest = b.ttft.get(outcome, (0, 0.0, 0.0))
            b.ttft[outcome] = [n + 1, total + ttft_s, max(slowest, ttft_s)]
            b.sources[source] = b.sources.get(source, 0) + 1
            b.reused += reused
            b.prefilled += prefilled

    def disk(self, model: str, disk_bytes: int, budget_bytes: int | None) -> None:
        """The model's stored caches' bytes now, and their budget (None: unbounded)."""
        with self._lock:
            b = self._current(model)
            b.disk_bytes, b.disk_budget_bytes = disk_bytes, budget_bytes

    def since(self, start: float) -> dict[str, list[dict[str, Any]]]:
        """Per model, the buckets that start at or after ``start`` (oldest first): a page
        asks again from its last bucket's start, which is still filling."""
        with self._lock:
            return {
                model: [b.as_dict() for b in buckets if b.start >= start]
                for model, buckets in self._models.items()
            }

    def _current(self, model: str) -> _Bucket:
        start = self._clock() // self.step_s * self.step_s
        buckets = self._models.setdefault(model, deque(maxlen=self.max_buckets))
        if not buckets or buckets[-1].start < start:
            buckets.append(_Bucket(start))
        return buckets[-1]
