"""Where a store shared by workers lives and how a worker meets it (``StoreConfig``),
resolved once with the engine's settings (``engine.config``) and handed to ``open_store``."""

from __future__ import annotations

from dataclasses import dataclass

from .objects import RemoteConfigError
from .urls import redacted


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """A shared store: ``records`` in PostgreSQL (a ``postgresql://`` URL), ``blocks`` in
    S3-compatible storage (an ``s3://`` URL); each engine's cache directory is the local
    tier in front of it."""

    records: str
    blocks: str
    #: start with the store out of reach (serve from the local tier, upload once it answers)
    #: instead of failing with the cause
    lazy: bool = False
    #: seconds a request waits for another worker's save of its agent in flight (hand-off)
    handoff_wait_s: float = 10.0

    @classmethod
    def of(
        cls, records: str | None, blocks: str | None, *, lazy: bool = False, handoff_wait_s: float = 10.0
    ) -> StoreConfig | None:
        """Both URLs, or neither (None: no shared store); one alone is a ``RemoteConfigError``."""
        if not records and not blocks:
            return None
        if not (records and blocks):
            raise RemoteConfigError(
                "a shared store needs both store='postgresql://...' (records) and blocks='s3://...' "
                f"(blocks); got store={redacted(records or '')!r}, blocks={redacted(blocks or '')!r}"
            )
        if handoff_wait_s < 0:
            raise ValueError(f"handoff_wait_s must be 0 or more seconds, not {handoff_wait_s}")
        return cls(records, blocks, lazy, handoff_wait_s)
