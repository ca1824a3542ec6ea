"""Which cache fetched a keys array, for attention over another layer's keys and values.

Some models hand a layer's fetched keys and values to later layers that keep none of their
own (Gemma 3n / 4's KV-shared layers, AFM's KV-reuse layers): those call attention without
a cache. Where the engine's attention is adapted (``model.adapters``), the fetched arrays
may be placeholders for the stored form (``LayerCache.attend`` reads it directly), so the
adapted attention finds the cache that fetched them here, by the arrays' identity, and
attends through it. Per thread (each engine's model runs on its worker thread) and weak (a
finished agent's caches are not kept alive by it).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

_local = threading.local()


def _owners() -> weakref.WeakValueDictionary[int, Any]:
    owners = getattr(_local, "owners", None)
    if owners is None:
        owners = _local.owners = weakref.WeakValueDictionary()
    return owners


def note(keys: Any, cache: Any) -> None:
    """``cache``'s ``update_and_fetch`` just returned ``keys``."""
    _owners()[id(keys)] = cache


def owner(keys: Any, values: Any) -> Any | None:
    """The cache whose last fetch returned ``keys`` and ``values``, if any."""
    cache = _owners().get(id(keys))
    return cache if cache is not None and cache.fetched(keys, values) else None
