"""A turn's save writes its own tokens' K/V only: the agent's partly filled last block is
continued by a segment of the new rows (``Block.rows_from``), not written again whole. The
chain still reloads token for token like the hot run, every record names the blocks its
segments continue (a fork or a sharer outlives the agent that wrote them), and a damaged
block under a segment costs a prefill, never a save."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from langchain_agent_memory import corpus
from langchain_agent_memory.engine.engine import Engine, GenerationParams
from langchain_agent_memory.engine.model.loading import LoadedModel
from langchain_agent_memory.engine.prefix import MatchKind
from langchain_agent_memory.engine.storage.blocks import BLOCK_TOKENS

GREEDY = GenerationParams(max_tokens=10)
SYSTEM = corpus.apache_license()[:1900]  # ~400 tokens: block 1 is partly filled
TOPICS = ["patents", "trademarks", "warranty", "liability", "redistribution", "notices"]
QUESTIONS = [f"\nQ{i}: What does section {i} of the license say about {t}?\nA:" for i, t in enumerate(TOPICS)]


def _conversation(engine: Engine, agent: str, turns: int) -> tuple[str, list[int], list[int]]:
    """``turns`` turns on ``agent``, each saved before the next: the prompt of the last turn
    with its reply, and per turn the bytes its save wrote and the tokens its record gained."""
    prompt, written, gained, before = SYSTEM, [], [], 0
    for question in QUESTIONS[:turns]:
        prompt += question
        reply = engine.generate(agent, prompt, GREEDY)
        engine.flush()
        prompt += reply.text
        record = engine.admin.store.get_agent(agent)
        assert record is not None
        written.append(reply.bytes_written)
        gained.append(len(record.token_ids) - before)
        before = len(record.token_ids)
    return prompt, written, gained


@pytest.mark.parametrize("kv_bits", [None, 4])
def test_a_turn_writes_its_new_tokens_and_the_chain_reloads_like_the_hot_run(
    smollm: LoadedModel, tmp_path: Path, kv_bits: int | None
) -> None:
    hot = Engine("smollm2-135m", cache_dir=tmp_path, kv_bits=kv_bits)
    prompt, written, gained = _conversation(hot, "a", 6)
    record = hot.admin.store.get_agent("a")
    assert record is not None and len(record.token_ids) > 2 * BLOCK_TOKENS  # block 1 filled by segments
    assert len(record.priors) >= 4  # ... and block 2 begun
    # Turns 2-6 write what their tokens take, the same bytes per token whatever the length of
    # the block they continue (a rewrite of that block grew with it: 3.5x on average).
    per_token = {w / g for w, g in zip(written[1:], gained[1:], strict=True)}
    assert len(per_token) == 1, (written, gained)
    assert written[0] >= gained[0] * min(per_token)  # turn 1: whole blocks (block 0's head at 16 bits)

    # Reload (a new engine: nothing in memory) continues token for token like the hot one.
    nxt = prompt + "\nQ9: Summarize it.\nA:"
    warm = Engine("smollm2-135m", cache_dir=tmp_path, kv_bits=kv_bits).generate("a", nxt, GREEDY)
    again = hot.generate("a", nxt, GREEDY)
    assert str(warm.outcome) == "warm-extend" and str(again.outcome) == "hot-extend"
    assert warm.reused_tokens == again.reused_tokens > 2 * BLOCK_TOKENS
    if kv_bits is None:  # at 16 bits the stored rows are the computed ones: equal to a cold run
        assert warm.text == again.text


def test_forks_and_sharers_keep_the_blocks_segments_continue(smollm: LoadedModel, tmp_path: Path) -> None:
    """The writer of the segments is deleted: a fork of it and an agent that reused its
    whole blocks by content (SHARED) still reload, because their records name the blocks
    under those segments too."""
    eng = Engine("smollm2-135m", cache_dir=tmp_path)
    prompt, _, _ = _conversation(eng, "writer", 5)
    eng.admin.fork("writer", "fork")
    shared = eng.generate("sharer", prompt + "\nQ7: Is it permissive?\nA:", GREEDY)
    eng.flush()
    assert shared.outcome.match is MatchKind.SHARED and shared.reused_tokens >= 2 * BLOCK_TOKENS
    assert eng.admin.delete("writer")
    store = eng.admin.store
    for agent in ("fork", "sharer"):
        record = store.get_agent(agent)
        assert record is not None and record.priors
        assert all(store.has_block(h) for h in record.blocks), agent
    fresh = Engine("smollm2-135m", cache_dir=tmp_path)
    for agent in ("fork", "sharer"):
        text = fresh.admin.cached_text(agent)
        again = fresh.generate(agent, text + " And?", GREEDY)
        assert str(again.outcome) == "warm-extend", agent


def test_a_damaged_block_under_a_segment_costs_a_prefill_and_the_next_save_mends_it(
    smollm: LoadedModel, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    eng = Engine("smollm2-135m", cache_dir=tmp_path)
    prompt, _, _ = _conversation(eng, "a", 3)
    record = eng.admin.store.get_agent("a")
    assert record is not None and record.priors
    base = next(p for p in record.priors.values() if p not in record.priors)  # block 1's first part
    path = eng.admin.store.block_path(base)
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01  # one flipped bit in its tensor data
    path.write_bytes(bytes(data))
    fresh = Engine("smollm2-135m", cache_dir=tmp_path)
    nxt = prompt + "\nQ8: And the rest?\nA:"
    with caplog.at_level(logging.WARNING):
        again = fresh.generate("a", nxt, GREEDY)
    assert any("falling back to prefill" in r.message for r in caplog.records)
    assert again.reused_tokens <= BLOCK_TOKENS  # block 0 is sound (shared by content)
    cold = Engine("smollm2-135m", cache_dir=tmp_path / "cold").generate("b", nxt, GREEDY)
    assert again.text == cold.text
    fresh.flush()
    mended = fresh.admin.store.get_agent("a")
    assert mended is not None and all(fresh.admin.store.has_block(h) for h in mended.blocks)
    last = Engine("smollm2-135m", cache_dir=tmp_path).generate("a", nxt + again.text + " More?", GREEDY)
    assert str(last.outcome) == "warm-extend"


def test_another_worker_reads_a_segmented_chain_through_the_shared_store(
    smollm: LoadedModel, shared_store: tuple[str, str], tmp_path: Path
) -> None:
    """Worker A's turns leave segments; worker B (its own empty cache directory) fetches the
    chain from the store with the blocks its segments continue, and answers like A."""
    store, blocks = shared_store
    with Engine("smollm2-135m", cache_dir=tmp_path / "a", kv_bits=None, store=store, blocks=blocks) as a:
        prompt, _, _ = _conversation(a, "agent", 4)
        record = a.admin.store.get_agent("agent")
        assert record is not None and record.priors
        nxt = prompt + "\nQ8: Anything else?\nA:"
        hot = a.generate("agent", nxt, GREEDY)
    with Engine("smollm2-135m", cache_dir=tmp_path / "b", kv_bits=None, store=store, blocks=blocks) as b:
        stored = b.admin.store.get_agent("agent")  # A's last save, segments and all
        assert stored is not None and len(stored.priors) > len(record.priors)
        turn = b.generate("agent", nxt + hot.text + "\nQ9: Why?\nA:", GREEDY)
        assert str(turn.outcome) == "warm-extend" and turn.reused_tokens == len(stored.token_ids)
