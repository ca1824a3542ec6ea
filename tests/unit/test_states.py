"""A hybrid model's state snapshots: the thinning policy, their block names (content
addresses: pinned, stored caches depend on them) and the agent records that name them."""

from __future__ import annotations

import json

import pytest

from langchain_agent_memory.engine.caches.states import keep, snapshot_hash
from langchain_agent_memory.engine.storage.blocks import (
    BLOCK_TOKENS,
    FORMAT_VERSION,
    STATES_FORMAT_VERSION,
    AgentRecord,
    BlockHash,
    CacheFormatError,
    block_hash,
    state_block_hash,
)

FP = "f" * 64


def test_the_policy_keeps_the_end_the_last_blocks_and_one_per_doubling() -> None:
    n = 32 * 1024 + 100  # a 32K agent: every block end snapshotted, and the turn's end
    candidates = {b * BLOCK_TOKENS for b in range(1, n // BLOCK_TOKENS + 1)} | {n - 1}
    kept = keep(candidates, n)
    assert kept[-1] == n - 1  # the end of the turn, always
    assert {p for p in kept if p >= n - 4 * BLOCK_TOKENS} == {
        p for p in candidates if p >= n - 4 * BLOCK_TOKENS
    }
    # Pinned: 10 snapshots for 128 blocks (the disk a 32K agent's states take).
    assert kept == [16384, 24576, 28672, 30720, 31744, 32000, 32256, 32512, 32768, 32867]
    # Every DIVERGE re-runs at most about as many tokens as lie between it and the end.
    for t in range(BLOCK_TOKENS, n, 97):
        resume = max((p for p in kept if p <= t), default=0)
        assert t - resume <= max(BLOCK_TOKENS, n - t), t


def test_the_policy_only_picks_from_its_candidates() -> None:
    assert keep([], 1000) == []
    assert keep([300, 999, 2000], 1000) == [300, 999]
    assert keep([5], 5) == [5]


def test_snapshot_names_are_pinned() -> None:
    """A snapshot's block is the child of the chain block holding its last token, with a
    sentinel "token" saying how far before that block's end it is."""
    h = block_hash(None, list(range(BLOCK_TOKENS)), FP)
    assert state_block_hash(h, FP) == block_hash(h, [0xFFFFFFFF], FP)
    assert state_block_hash(h, FP, 1) == block_hash(h, [0xFFFFFFFE], FP)
    assert state_block_hash(h, FP) == "1ebccb5f65879687d01bad6732310f6bdeb4290da7984c0588f3b61b7519a648"
    chain = [h, block_hash(h, [1, 2, 3], FP)]
    assert snapshot_hash(chain, 259, 256, FP) == state_block_hash(h, FP)
    assert snapshot_hash(chain, 259, 258, FP) == state_block_hash(chain[1], FP, 1)
    with pytest.raises(ValueError, match="within its block"):
        state_block_hash(h, FP, BLOCK_TOKENS)


def test_records_with_snapshots_are_format_2_and_checked() -> None:
    chain = [BlockHash("a" * 64), BlockHash("b" * 64)]
    snap = BlockHash("c" * 64)
    ids = list(range(300))
    record = AgentRecord("x", [*chain, snap], ids, ids, "t", states=[299])
    raw = record.to_json()
    assert json.loads(raw)["format_version"] == STATES_FORMAT_VERSION
    back = AgentRecord.from_json(raw)
    assert back.chain == chain and back.state_blocks() == {299: snap}
    plain = AgentRecord("y", chain, ids, ids, "t").to_json()
    assert json.loads(plain)["format_version"] == FORMAT_VERSION and "states" not in json.loads(plain)
    for bad in ([301], [5, 5], [10, 3], [0]):
        with pytest.raises(CacheFormatError, match="state snapshots"):
            AgentRecord.from_json(json.dumps({**json.loads(raw), "states": bad}))


def test_a_long_prefill_holds_only_the_snapshots_its_commit_can_keep() -> None:
    """After each chunk of a 32K prefill, the request keeps the snapshots ``keep`` would keep
    at its prompt's end (and a waiting fork's point), not one per block passed."""
    from langchain_agent_memory.engine.caches.agent_state import Admission
    from langchain_agent_memory.engine.caches.states import thin_held
    from langchain_agent_memory.engine.kv import LayerSpec, RecurrentCache
    from langchain_agent_memory.engine.ops.runtime import mx
    from langchain_agent_memory.engine.prefix import MatchKind, PrefixMatch, TokenizedText
    from langchain_agent_memory.engine.results import CacheSource

    n = 32 * 1024
    layer = RecurrentCache(LayerSpec(0, 0, 0, None, (((2,), "float32"),)))
    tail = TokenizedText("x" * n, [1] * n, list(range(1, n + 1)))
    start = Admission(
        state=None, source=CacheSource.COLD, match=PrefixMatch(MatchKind.MISS, 0, 0), layers=[layer],  # type: ignore[list-item]
        known=TokenizedText(""), tail=tail, load_s=0.0, prefix_blocks=[],
    )  # fmt: skip
    most = 0
    for p in range(BLOCK_TOKENS, n + 1, BLOCK_TOKENS):  # one block per chunk, as a prefill runs
        layer.cache, layer.offset = [mx.zeros((1, 2))], p
        layer.snapshot()
        thin_held(start, pinned=[1024])
        most = max(most, len(layer.snapshots))
    assert most <= 12
    held = sorted(layer.snapshots)
    assert held == sorted(set(keep(range(BLOCK_TOKENS, n + 1, BLOCK_TOKENS), n)) | {1024})


def test_an_agent_of_many_short_turns_keeps_one_snapshot_per_block() -> None:
    """Forty turns of 50 tokens each leave a prompt's end and a reply's end per turn: the
    policy keeps the newest of each recent block and the last prompt's end, not 80."""
    candidates = {t * 50 + d for t in range(1, 41) for d in (-10, -1)}  # prompt end, turn end - 1
    n = 40 * 50
    kept = keep(candidates, n, also=[n - 10])
    assert n - 1 in kept and n - 10 in kept
    recent = [p for p in kept if p >= n - 4 * BLOCK_TOKENS]
    assert len(recent) <= 4 + 2
    assert len(kept) <= 10


def test_snapshots_take_at_most_the_bytes_of_the_agents_kv() -> None:
    """On Qwen3-Next-80B-A3B's layers (36 delta-rule layers of 32 x 128 x 128 float32 and a
    bfloat16 convolution window; 12 attention layers of 2 x 256-wide KV heads) in the
    default format, a 32K agent keeps 3 snapshots (232 MB against 278 MB of K/V), where
    the unbounded policy keeps 10: the end, then the nearest doublings. Pinned: stored
    caches depend on it."""
    from langchain_agent_memory.engine.caches.states import snapshot_limit
    from langchain_agent_memory.engine.kv import LayerSpec, ModelCacheSpec, kv_format
    from langchain_agent_memory.engine.kv.layer import make_layer_caches

    delta = LayerSpec(0, 0, 0, None, (((3, 8192), "bfloat16"), ((32, 128, 128), "float32")))
    attention = LayerSpec(2, 256, 256, None)
    spec = ModelCacheSpec(tuple([delta, delta, delta, attention] * 12), "bfloat16")
    layers = make_layer_caches(spec, kv_format(4))
    n = 32 * 1024 + 100
    assert snapshot_limit(layers, n) == 3
    assert snapshot_limit(layers, n, budget=None) is None
    assert snapshot_limit(layers, 1000) == 2  # the end and one doubling, whatever they weigh
    assert snapshot_limit(make_layer_caches(spec, kv_format(None)), n) == 10  # 16-bit K/V: all 10 fit
    candidates = {b * BLOCK_TOKENS for b in range(1, n // BLOCK_TOKENS + 1)} | {n - 1, n - 100}
    kept = keep(candidates, n, also=[n - 100], limit=3)
    assert kept == [30720, 31744, 32867]
    # A DIVERGE 1K tokens back resumes a little before its point, not from the start.
    t = n - 1024
    assert t - max(p for p in kept if p <= t) < BLOCK_TOKENS
    # Raising the limit adds the far doublings, then the prompt's end, then recent blocks.
    assert keep(candidates, n, also=[n - 100], limit=7) == [16384, 24576, 28672, 30720, 31744, 32768, 32867]


def test_a_commit_keeps_no_snapshot_that_ends_inside_a_character() -> None:
    """A snapshot after a token that ends inside a character (byte-level BPE splits emoji) is
    never a resume point: the commit keeps the prompt's end and whole-character block
    boundaries instead of it."""
    from langchain_agent_memory.engine.caches.agent_state import Admission
    from langchain_agent_memory.engine.caches.states import commit_snapshots
    from langchain_agent_memory.engine.kv import LayerSpec, RecurrentCache
    from langchain_agent_memory.engine.ops.runtime import mx
    from langchain_agent_memory.engine.prefix import NOT_A_BOUNDARY, MatchKind, PrefixMatch, TokenizedText
    from langchain_agent_memory.engine.results import CacheSource

    n, prompt_end = 600, 590
    ends = list(range(1, n + 1))
    ends[511] = ends[598] = NOT_A_BOUNDARY  # tokens 512 and 599 end inside a character
    known = TokenizedText("x" * n, [1] * n, ends)
    layer = RecurrentCache(LayerSpec(0, 0, 0, None, (((2,), "float32"),)))
    for p in (256, 512, prompt_end, n - 1, n):
        layer.cache, layer.offset = [mx.full((1, 2), float(p))], p
        layer.snapshot()
    tail = TokenizedText("x" * prompt_end, [1] * prompt_end, list(range(1, prompt_end + 1)))
    start = Admission(
        state=None, source=CacheSource.COLD, match=PrefixMatch(MatchKind.MISS, 0, 0), layers=[layer],  # type: ignore[list-item]
        known=TokenizedText(""), tail=tail, load_s=0.0, prefix_blocks=[],
    )  # fmt: skip
    chain = [block_hash(None, [1] * BLOCK_TOKENS, FP)]
    chain += [block_hash(chain[0], [1] * BLOCK_TOKENS, FP)]
    chain += [block_hash(chain[1], [1] * (n - 2 * BLOCK_TOKENS), FP)]
    kept, blocks, at_end = commit_snapshots(start, chain, known, FP, lambda h: False)
    assert sorted(kept) == [256, prompt_end] and at_end
    assert set(blocks) == set(kept.values())
