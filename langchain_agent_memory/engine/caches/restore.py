"""An agent's layer caches built from its blocks (a warm start, a prefetch): each block from
where it is (a save's queue or the pool's memory tier one by one; every run of the others
in one read from disk, a few device arrays), each layer from the blocks it needs (a
sliding-window layer only its last window's)."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Protocol

from ..kv import LayerCache, RecurrentCache
from ..kv.recurrent import states_of
from ..ops.runtime import mx
from ..prefix import NOT_A_BOUNDARY, TokenizedText
from ..storage.blocks import BLOCK_TOKENS, Block, BlockHash, CacheFormatError
from ..storage.pool import BlockPool
from ..storage.protocols import StoreReads
from ..storage.reader import BlockGroup


class BlockSources(Protocol):
    """Where an agent's blocks are (``AgentCaches``)."""

    pool: BlockPool
    reads: StoreReads

    def new_layers(self) -> list[LayerCache]: ...
    def queued_block(self, h: BlockHash) -> Block | None: ...
    def held(self, h: BlockHash) -> bool: ...
    def has_local(self, h: BlockHash) -> bool: ...


def layers_from_blocks(
    caches: BlockSources,
    chain: list[BlockHash],
    n_tokens: int,
    only: Collection[int] | None = None,
    state: BlockHash | None = None,
) -> tuple[list[LayerCache], bool]:
    """Layer caches of the first ``n_tokens`` of ``chain``, and whether a block was read
    from disk. A sliding-window layer reads only the blocks of its last window: blocks
    before every window are read for the full-attention layers' tensors alone. ``only``:
    build these layers (the others come back empty) and read nothing for the rest. A
    hybrid model's recurrent layers load the snapshot block ``state`` (their state after
    ``n_tokens``; ``states``)."""
    layers = caches.new_layers()
    n_blocks = -(-n_tokens // BLOCK_TOKENS)
    if len(chain) < n_blocks:
        raise CacheFormatError(f"agent record names {len(chain)} blocks for {n_tokens} tokens")
    built = sorted(only) if only is not None else list(range(len(layers)))
    recurrent = [i for i in built if isinstance(layers[i], RecurrentCache)]
    from_disk = _load_states(caches, layers, recurrent, n_tokens, state)
    built = [i for i in built if i not in recurrent]
    if not built:
        return layers, from_disk
    first = [
        0 if layer.spec.window is None else max(0, n_tokens - layer.spec.window) // BLOCK_TOKENS
        for layer in layers
    ]
    base, every = min(first[i] for i in built), max(first[i] for i in built)

    def wanted(j: int) -> frozenset[int] | None:
        """The layers that need block ``base + j`` (None: all of them)."""
        b = base + j
        if b >= every and only is None:
            return None
        return frozenset(i for i in built if first[i] <= b)

    needed = chain[base:n_blocks]
    runs = _sources(caches, needed, wanted)
    from_disk = from_disk or any(isinstance(src, BlockGroup) for _, src in runs)
    for i in built:
        layer = layers[i]
        own = first[i] - base
        parts = [_layer_part(i, src, max(0, own - b0)) for b0, src in runs if b0 + _n_blocks(src) > own]
        try:
            layer.from_blocks(i, first[i] * BLOCK_TOKENS, [t for t, _ in parts], sum(n for _, n in parts))
        except KeyError as exc:
            raise CacheFormatError(f"a block lacks tensor {exc}; it was written by another version") from None
        except ValueError as exc:
            raise CacheFormatError(str(exc)) from None
        layer.trim_to(n_tokens)
    return layers, from_disk


def _load_states(
    caches: BlockSources, layers: list[LayerCache], recurrent: list[int], n_tokens: int, h: BlockHash | None
) -> bool:
    """Load ``recurrent`` layers with the snapshot block ``h`` (their state after ``n_tokens``);
    whether it was read from disk."""
    if not recurrent:
        return False
    if n_tokens == 0:
        for i in recurrent:
            layers[i].load(0, None)  # type: ignore[call-arg]
        return False
    if h is None:
        raise CacheFormatError(f"no recurrent-state snapshot at {n_tokens} tokens (this is a bug)")
    block, from_disk = caches.queued_block(h), False
    if block is None:
        block, in_memory = caches.pool.get(h)
        from_disk = not in_memory
    try:
        states = states_of(block.tensors, [layer.spec for layer in layers])
    except KeyError as exc:
        raise CacheFormatError(
            f"a state snapshot lacks tensor {exc}; it was written by another version"
        ) from None
    except ValueError as exc:
        raise CacheFormatError(str(exc)) from None
    for i in recurrent:
        layers[i].load(n_tokens, states[i])  # type: ignore[call-arg]
    return from_disk


def _sources(
    caches: BlockSources, needed: list[BlockHash], wanted: Callable[[int], frozenset[int] | None]
) -> list[tuple[int, BlockGroup | Block]]:
    """Where each of ``needed`` comes from, as (index of its first block, source): blocks
    in the pool's memory tier one by one; every run of the others that the same layers
    need (``wanted``) in one read from disk (``reader``: a few device arrays, not one
    read per block)."""
    runs: list[tuple[int, BlockGroup | Block]] = []
    b = 0
    while b < len(needed):
        held = caches.queued_block(needed[b])  # written by a save not done yet
        if held is not None or caches.pool.is_hot(needed[b]):
            runs.append((b, held or caches.pool.get(needed[b])[0]))  # a pool hit is touched
            b += 1
            continue
        end, layers = b, wanted(b)
        while end < len(needed) and not caches.held(needed[end]) and wanted(end) == layers:
            end += 1
        b0 = b
        for group in caches.reads.blocks.read(needed[b:end], layers):
            runs.append((b0, group))
            b0 += len(group.headers)
        caches.pool.stats.misses += end - b
        b = end
    return runs


def _n_blocks(source: BlockGroup | Block) -> int:
    return len(source.headers) if isinstance(source, BlockGroup) else 1


def _layer_part(index: int, source: BlockGroup | Block, skip: int) -> tuple[dict[str, mx.array], int]:
    """Layer ``index``'s tensors in ``source`` (a read group or one pooled block) from its
    ``skip``-th block on, and how many tokens they hold."""
    prefix = f"L{index}."
    if isinstance(source, Block):
        # Names first: a pooled block's tensors are slices cut when read (``TokenSlices``),
        # and cutting every layer's for each layer was 90 % of a shared-prefix admission.
        tensors = source.tensors
        return {k: tensors[k] for k in tensors if k.startswith(prefix)}, len(source.token_ids)
    names = [k for k in source.names() if k.startswith(prefix)]
    tokens = sum(hd.n_tokens for hd in source.headers[skip:])
    return {k: source.tensor(k, skip) for k in names}, tokens


def available_prefix(
    caches: BlockSources, chain: list[BlockHash], tokens: TokenizedText, n_tokens: int
) -> int:
    """The most of the first ``n_tokens`` of ``chain`` (standing for ``tokens``) whose blocks
    are here (pool or this worker's disk), ending at a token boundary."""
    k = 0
    while k < len(chain) and caches.has_local(chain[k]):
        k += 1
    n = min(n_tokens, k * BLOCK_TOKENS)
    while n and tokens.ends[n - 1] == NOT_A_BOUNDARY:
        n -= 1
    return n
