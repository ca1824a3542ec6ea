"""A commit's new blocks cut from an agent's layer caches: consecutive ones every layer holds
whole from one array per layer and part over their run (one evaluation, one host view each),
the others one by one (block 0 with its 16-bit head tokens, hot-tier blocks, blocks a
sliding layer no longer holds)."""

from __future__ import annotations

from typing import Any

from ..kv import LayerCache
from ..ops.runtime import mx
from ..prefix import TokenizedText
from ..storage.blocks import (
    BLOCK_TOKENS,
    Block,
    BlockHash,
    CacheWriteError,
    HostTensor,
    TokenSlices,
    host_views,
)
from ..storage.pool import BlockPool


def blocks_of(
    pool: BlockPool,
    indices: list[int],
    chain: list[BlockHash],
    known: TokenizedText,
    layers: list[LayerCache],
) -> dict[BlockHash, Block]:
    """Blocks ``indices`` of ``chain``. Consecutive ones every layer holds whole (not
    block 0, with its 16-bit head tokens; not one of the hot tier) are cut from one
    array per layer and part over their run, evaluated and viewed from the host once:
    a 32K turn of an 8B model is 128 blocks x 32 layers x 6 parts, and an array (and a
    wait, and a host view) per block, layer and part took 2.1 s of the model's thread
    on the H200."""
    out: dict[BlockHash, Block] = {}
    run: list[int] = []

    def cut() -> None:
        if run:
            out.update(run_of(run, chain, known, layers))
            run.clear()

    for b in indices:
        whole = b > 0 and all(layer.start <= b * BLOCK_TOKENS for layer in layers)
        if whole and pool.hot_block(chain[b]) is None:
            if run and b != run[-1] + 1:
                cut()
            run.append(b)
        else:
            cut()
            out[chain[b]] = block_of(pool, b, chain, known, layers)
    cut()
    return out


def run_of(
    run: list[int], chain: list[BlockHash], known: TokenizedText, layers: list[LayerCache]
) -> dict[BlockHash, Block]:
    """Consecutive blocks ``run``: each one's tensors views of arrays over the run, its
    host bytes views of their host memory (see ``blocks_of``).

    Served from the stored form (a GPU), the arrays are the layers' own body buffers: the
    save reads its rows from them, where a copy of the run's rows (the whole stored form,
    for a first turn) stayed in the device's memory until the write, seconds later (16
    agents of 8K tokens: 6 GB of an H100 beside the agents' own). A later append to a
    buffer the save still reads copies it (mlx's buffers are copied on write while shared)."""
    a0, z1 = run[0] * BLOCK_TOKENS, min((run[-1] + 1) * BLOCK_TOKENS, len(known))
    spans: dict[str, mx.array] = {}
    copies: dict[str, mx.array] = {}
    hosts: dict[str, HostTensor] = {}
    for i, layer in enumerate(layers):
        held = layer.body_buffers(i, a0, z1) if isinstance(layer, LayerCache) and layer.serve_stored else None
        if held is None:
            copies.update(layer.block_state(i, a0, z1))
            continue
        buffers, lo, hi = held
        whole = host_views(buffers)  # no copy: a contiguous buffer's memory is shared
        for name, buf in buffers.items():
            spans[name] = buf[:, :, lo:hi]
            hosts[name] = whole[name].rows(lo, hi)
    spans.update(copies)
    hosts.update(host_views(copies))
    out = {}
    for b in run:
        a, z = b * BLOCK_TOKENS, min((b + 1) * BLOCK_TOKENS, len(known))
        tensors, host = TokenSlices(spans, a - a0, z - a0), TokenSlices(hosts, a - a0, z - a0)
        out[chain[b]] = Block(chain[b], chain[b - 1], known.ids[a:z], tensors, host)
    return out


def block_of(
    pool: BlockPool, b: int, chain: list[BlockHash], known: TokenizedText, layers: list[LayerCache]
) -> Block:
    """Block ``b`` of ``chain``: from the hot tier if there, else from the layer caches."""
    hot = pool.hot_block(chain[b])
    if hot is not None:  # held in memory but its file is gone (deleted by another process)
        return hot
    a, z = b * BLOCK_TOKENS, min((b + 1) * BLOCK_TOKENS, len(known))
    tensors: dict[str, Any] = {}
    for i, layer in enumerate(layers):
        if a < layer.start:  # a sliding layer dropped it, and another process deleted it
            raise CacheWriteError(
                f"block {b} of this cache was deleted by another process and is no longer in "
                "memory; the cache was not saved (the next request prefills)"
            )
        tensors.update(layer.block_state(i, a, z))
    return Block(chain[b], chain[b - 1] if b else None, known.ids[a:z], tensors)
