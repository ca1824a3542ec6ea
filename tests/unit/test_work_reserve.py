"""The working-copy reserve of a CPU engine (``kv.reserve``): what it reserves within the
budget, that a warm restore's working copy takes the reserved buffers out of MLX's cache
(already touched), that the values are the same as without it, and that releasing it gives
the cache limit back (no model: random K/V through real layer caches)."""

from __future__ import annotations

import pytest

from langchain_agent_memory.engine.kv import LayerCache, kv_format
from langchain_agent_memory.engine.kv.buffers import grown_rows
from langchain_agent_memory.engine.kv.reserve import WorkReserve, reserve_rows
from langchain_agent_memory.engine.kv.spec import LayerSpec, ModelCacheSpec
from langchain_agent_memory.engine.ops.runtime import mx

FULL = LayerSpec(kv_heads=2, k_head_dim=64, v_head_dim=64, window=None)
SLIDING = LayerSpec(kv_heads=2, k_head_dim=64, v_head_dim=64, window=512)
SPEC = ModelCacheSpec((FULL, SLIDING, FULL), "float32")


def _restored(n: int, reserved: int) -> LayerCache:
    """A full-attention layer holding ``n`` committed tokens, as a warm restore loads it,
    with 15 new tokens appended (which builds its working copy)."""
    layer, new_k, new_v = _loaded(n, reserved)
    layer.update_and_fetch(new_k, new_v)
    return layer


def _loaded(n: int, reserved: int) -> tuple[LayerCache, mx.array, mx.array]:
    mx.random.seed(3)
    k, v = mx.random.normal((1, 2, n, 64)), mx.random.normal((1, 2, n, 64))
    stored = LayerCache(FULL, kv_format(4), mx.float32)
    stored.update_and_fetch(k, v)
    stored.commit()
    layer = LayerCache(FULL, kv_format(4), mx.float32, prefill_rotated=True, reserved_rows=reserved)
    layer.load(0, (stored.head_k, stored.head_v), stored.keys, stored.values)
    new_k, new_v = mx.random.normal((1, 2, 15, 64)), mx.random.normal((1, 2, 15, 64))
    mx.eval(layer.state, new_k, new_v)
    return layer, new_k, new_v


def test_reserved_rows_cover_the_context_within_the_budget() -> None:
    rows = reserve_rows(SPEC, context_length=8192, chunk_tokens=256, budget_bytes=1 << 30)
    assert rows == (grown_rows(8192), grown_rows(511 + 256), grown_rows(8192))
    # A budget too small for the whole context reserves the longest agent it holds, in
    # whole 256-row steps; one too small for anything reserves nothing.
    per_full_row = 2 * 2 * 64 * 4 * 2  # K and V, 2 heads, 64 wide, float32, 2 full layers
    sliding_bytes = grown_rows(767) * 2 * 2 * 64 * 4
    small = reserve_rows(SPEC, 8192, 256, sliding_bytes + 3000 * per_full_row)
    assert small[0] == small[2] == 2816 and small[1] == grown_rows(767)
    assert reserve_rows(SPEC, 8192, 256, 1 << 10) == (0, 0, 0)


def test_a_warm_working_copy_takes_the_reserved_buffer_and_the_same_values() -> None:
    n = 3000
    reserved = grown_rows(n + 15) + 512  # an engine context a little longer than the agent
    plain, held = _restored(n, 0), _restored(n, reserved)
    assert held._work is not None and plain._work is not None
    assert held._work.k.shape[2] == reserved and plain._work.k.shape[2] == grown_rows(n + 15)
    used = n + 15
    assert mx.array_equal(held._work.k[:, :, :used], plain._work.k[:, :, :used]).item()
    assert mx.array_equal(held._work.v[:, :, :used], plain._work.v[:, :, :used]).item()
    # An agent too short for the reserve (more than half of it would be spare) keeps its size.
    short = _restored(300, reserved)
    assert short._work is not None and short._work.k.shape[2] == grown_rows(315)


def _cache_limit() -> int:
    limit = mx.set_cache_limit(1 << 62)
    mx.set_cache_limit(limit)
    return limit


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="MLX's CPU buffer cache")
def test_the_reserve_waits_in_mlx_cache_until_a_working_copy_takes_it() -> None:
    mx.clear_cache()
    limit = _cache_limit()
    rows = (grown_rows(3015) + 512, 0, 0)
    reserve = WorkReserve(SPEC, rows)
    try:
        assert reserve.nbytes == 2 * 2 * rows[0] * 64 * 4
        assert mx.get_cache_memory() >= reserve.nbytes  # touched, then parked in the cache
        layer, new_k, new_v = _loaded(3000, rows[0])
        before = mx.get_cache_memory()
        layer.update_and_fetch(new_k, new_v)
        mx.eval(layer._work.k, layer._work.v)  # type: ignore[union-attr]
        # Its K and V buffers (4 MB each) came out of the cache; the few temporaries of the
        # decode (the packed parts padded, < 1 MB) went into it.
        taken = before - mx.get_cache_memory()
        assert taken >= 2 * rows[0] * 2 * 64 * 4 * 3 // 4
        assert _cache_limit() == limit + reserve.nbytes
    finally:
        reserve.release()
    assert _cache_limit() == limit
