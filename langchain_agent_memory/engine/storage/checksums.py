"""A block's integrity digests: SHA-256 and XXH3-128 over (name, NUL, bytes) of its tensors
in name order, whole and by layer, as its writer records them in its header
(``block_checksums``) and as a reader checks them (``reader.sound``).

XXH3-128 (``fast_checksum``: ~15 GB/s a core) is what a restore verifies, so that it runs at
the disk's speed rather than SHA-256's ~1.5 GB/s; SHA-256 (``checksum``) stays beside it for
readers that know only it, and checks blocks written before XXH3 was added.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any

import xxhash

from ..ops.process import RUNTIME

#: Threads hashing a block being written (hashlib and xxhash let go of the GIL).
HASH_THREADS = min(16, os.cpu_count() or 1)


def layer_of(name: str) -> str:
    """The layer a block tensor belongs to: ``L3`` for ``L3.k.q``."""
    return name.split(".", 1)[0]


def _by_layer(named: Sequence[tuple[str, Any]]) -> dict[str, list[tuple[str, Any]]]:
    by_layer: dict[str, list[tuple[str, Any]]] = {}
    for name, data in named:
        by_layer.setdefault(layer_of(name), []).append((name, data))
    return dict(sorted(by_layer.items()))


Digest = Callable[[Sequence[tuple[str, Any]]], str]


def part_checksums(named: Sequence[tuple[str, Any]], digest: Digest | None = None) -> dict[str, str]:
    """``digest`` (default ``checksum``) of each layer's tensors, by layer (what a partial
    read verifies)."""
    digest = digest or checksum
    return {layer: digest(group) for layer, group in _by_layer(named).items()}


#: Header fields of a block's integrity digests: (whole, by layer), the fastest first.
FAST_FIELDS = ("xxh3", "part_xxh3")
SHA_FIELDS = ("checksum", "part_checksums")


def covered(meta: dict[str, str], *, whole: bool) -> bytes:
    """The header fields an XXH3 digest covers, in one spelling: the whole block's, every
    field but its own (the layers' digests included, so that a damaged one is found by a
    whole read too); a layer's, every field but the XXH3 ones."""
    mine = FAST_FIELDS[:1] if whole else FAST_FIELDS
    kept = {k: v for k, v in meta.items() if k not in mine}
    return json.dumps(kept, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def hash_pool() -> Executor:
    """The process's ``HASH_THREADS`` hashing threads (the runtime's: made on first use)."""
    return RUNTIME.shared_pool("agent-memory-hash", HASH_THREADS)


def block_checksums(named: Sequence[tuple[str, Any]], meta: dict[str, str]) -> dict[str, str]:
    """``meta`` with a block's digests added (``SHA_FIELDS``, ``FAST_FIELDS``): SHA-256, whole
    and by layer; XXH3-128 by layer (covering those and ``meta``), then whole (covering every
    other field: ``covered``). Hashed side by side on threads (hashlib and xxhash let go of
    the GIL over a large buffer): a save of a Gemma 3 4B-shaped agent of 32K tokens on the
    H200 spent 3.1 of its 7.1 s in SHA-256, on one thread."""
    by_layer = _by_layer(named)
    pool = hash_pool()

    def run(digest: Digest) -> tuple[str, str]:
        """(the whole digest, the layers' as JSON)."""
        try:
            whole = pool.submit(digest, named)
            parts = dict(zip(by_layer, pool.map(digest, by_layer.values()), strict=True))
            return whole.result(), json.dumps(parts, separators=(",", ":"))
        except RuntimeError:  # the runtime is shutting down (a save still being written): one thread
            parts = {layer: digest(group) for layer, group in by_layer.items()}
            return digest(named), json.dumps(parts, separators=(",", ":"))

    fields = dict(meta)
    fields[SHA_FIELDS[0]], fields[SHA_FIELDS[1]] = run(checksum)
    _, fields[FAST_FIELDS[1]] = run(functools.partial(fast_checksum, meta=covered(fields, whole=False)))
    fields[FAST_FIELDS[0]] = fast_checksum(named, meta=covered(fields, whole=True))
    return fields


def checksum(named: Sequence[tuple[str, Any]]) -> str:
    """SHA-256 over (name, NUL, bytes) of tensors in name order: what every block's header
    stores (``tensor_checksum`` over arrays; here over the raw bytes just read)."""
    return _digest(hashlib.sha256(), named)


def fast_checksum(named: Sequence[tuple[str, Any]], meta: bytes = b"") -> str:
    """XXH3-128 over ``meta`` (the header fields it covers) and then the bytes ``checksum``
    hashes: what a restore verifies, at memory speed (pinned by a golden test: it names
    nothing, but every reader must agree with every writer)."""
    h = xxhash.xxh3_128()
    h.update(meta)
    return _digest(h, named)


class Gathered(Sequence[tuple[str, Any]]):
    """A whole block's digest input gathered into one buffer (``gather``): each tensor's
    name, a NUL and its bytes, in name order. ``checksum`` and ``fast_checksum`` hash it in
    one call; it stands for the (name, bytes) pairs it was made of, but does not list them
    (a digest by layer needs those: it is refused)."""

    def __init__(self, stream: memoryview) -> None:
        self.stream = stream

    def __len__(self) -> int:
        raise TypeError("a gathered block is hashed whole, not tensor by tensor")

    def __getitem__(self, i: Any) -> Any:
        raise TypeError("a gathered block is hashed whole, not tensor by tensor")


def _digest(h: Any, named: Sequence[tuple[str, Any]]) -> str:
    if isinstance(named, Gathered):
        h.update(named.stream)
        return str(h.hexdigest())
    for name, data in sorted(named, key=lambda x: x[0]):
        h.update(name.encode() + b"\x00")
        h.update(data)
    return str(h.hexdigest())
