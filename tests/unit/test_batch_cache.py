"""A decode batch keeps its merged buffers while members join (``extend``) and leave
(``filter``): every member attends to exactly what it would alone, through our attention
(CPU path) and through mlx's fused op over the protocol's arrays and mask (GPU path), and a
member that leaves gets its rows back (no model: random K/V)."""

from __future__ import annotations

import numpy as np

from langchain_agent_memory.engine.kv import BatchLayerCache, LayerCache, LayerSpec, kv_format
from langchain_agent_memory.engine.ops.runtime import mx

SPEC = LayerSpec(kv_heads=2, k_head_dim=64, v_head_dim=64, window=None)
LENGTHS = {"a": 100, "b": 230, "c": 40}


def _agent(n: int, seed: int) -> LayerCache:
    cache = LayerCache(SPEC, kv_format(None), mx.float32)
    mx.random.seed(seed)
    cache.update_and_fetch(mx.random.normal((1, 2, n, 64)), mx.random.normal((1, 2, n, 64)))
    cache.commit(keep_work=True)
    return cache


def _step(seed: int) -> tuple[mx.array, mx.array, mx.array]:
    """One token's query (6 heads: GQA over 2 KV heads), key and value."""
    kq, kk, kv = mx.random.split(mx.random.key(seed), 3)
    q = mx.random.normal((1, 6, 1, 64), key=kq)
    return q, mx.random.normal((1, 2, 1, 64), key=kk), mx.random.normal((1, 2, 1, 64), key=kv)


def _close(a: mx.array, b: mx.array) -> None:
    np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-5)


def test_members_join_and_leave_and_each_attends_as_alone() -> None:
    alone = {name: _agent(n, i) for i, (name, n) in enumerate(LENGTHS.items())}
    mine = {name: _agent(n, i) for i, (name, n) in enumerate(LENGTHS.items())}
    members = ["a", "c"]  # "b", longer than both, joins: the buffer shifts right
    batch = BatchLayerCache([mine[m] for m in members], mx.array([mine[m].offset for m in members]))
    plan = [("step", None), ("join", "b"), ("step", None), ("leave", "a"), ("step", None), ("step", None)]
    seed = 0
    for what, who in plan:
        if what == "join":
            batch.extend([mine[who]])
            members.append(who)
            continue
        if what == "leave":
            batch.filter([i for i, m in enumerate(members) if m != who])
            members.remove(who)
            continue
        steps = {m: _step(seed := seed + 1) for m in members}
        want = {}
        for m in members:
            q, k, v = steps[m]
            alone[m].update_and_fetch(k, v)
            want[m] = alone[m].attend(q, 0.125)
        batch.step(mx.array([mine[m].offset for m in members]))
        mask = batch.make_mask(1)
        q, k, v = (mx.concatenate([steps[m][j] for m in members], axis=0) for j in range(3))
        keys, values = batch.update_and_fetch(k, v)
        assert batch.fetched(keys, values)
        ours = batch.attend(q, 0.125)
        fused = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.125, mask=mask)
        for i, m in enumerate(members):
            _close(ours[i : i + 1], want[m])
            _close(fused[i : i + 1], want[m])
    batch.dissolve()
    # Everyone's rows went home: the next step alone reads the same keys as the reference.
    for m in LENGTHS:
        assert mine[m].offset == alone[m].offset
        q, k, v = _step(100)
        for cache in (alone[m], mine[m]):
            cache.update_and_fetch(k, v)
        _close(mine[m].attend(q, 0.125), alone[m].attend(q, 0.125))
        mine[m].commit()
        alone[m].commit()
        _close(mine[m].keys[0], alone[m].keys[0])  # type: ignore[index]


def _shares(a: mx.array, b: mx.array) -> bool:
    mx.eval(a, b)
    return bool(np.shares_memory(np.asarray(memoryview(a)), np.asarray(memoryview(b))))


def test_a_member_that_leaves_holds_its_own_rows_not_the_batchs_buffer() -> None:
    # A view of the merged buffer kept all members' rows (and its room) alive in every parked
    # agent's working copy: memory beyond what the hot tier counts (``work_nbytes``).
    caches = [_agent(n, i) for i, n in enumerate(LENGTHS.values())]
    batch = BatchLayerCache(caches, mx.array([c.offset for c in caches]))
    batch.step(mx.array([c.offset for c in caches]))
    _, k, v = _step(1)
    batch.update_and_fetch(mx.concatenate([k] * 3), mx.concatenate([v] * 3))
    merged = batch._merged
    assert merged is not None
    batch.filter([1, 2])  # "a" leaves
    batch.dissolve()  # the rest
    for cache in caches:
        work = cache.work.buf
        assert work is not None and work.k.shape[0] == 1
        assert not _shares(work.k, merged.k) and not _shares(work.v, merged.v)
        assert work.k.nbytes < merged.k.nbytes / 2  # its rows, not the batch's
        pending_k, _ = cache.pending.joined()
        assert pending_k is not None and not _shares(pending_k, merged.k)
