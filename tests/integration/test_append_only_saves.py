"""A turn's save does not write the agent's partly filled last block again whole: it writes a
segment (``Block.rows_from``) of the rows since the whole block that one starts from, or the
block whole where those would outnumber that prefix's; a turn that fills the block writes it
whole (one file, the block a one-turn save of the same text writes and shares), so that a
restore reads one file per full block and two at most for the last (its prefix and one
segment). The chain still reloads token for token like the hot run, every record names
the blocks its segments continue (a fork outlives the agent that wrote them), a damaged
block under a segment costs a prefill, never a save, and a crash between a filled block's
write and its record leaves the agent as its last save left it."""

from __future__ import annotations

import contextlib
import itertools
import logging
from pathlib import Path

import pytest

from langchain_agent_memory import corpus
from langchain_agent_memory.engine.engine import Engine, GenerationParams
from langchain_agent_memory.engine.model.loading import LoadedModel
from langchain_agent_memory.engine.prefix import MatchKind
from langchain_agent_memory.engine.storage.blocks import BLOCK_TOKENS, AgentRecord, BlockHash
from langchain_agent_memory.engine.storage.store import DiskBlockStore

GREEDY = GenerationParams(max_tokens=10)
SYSTEM = corpus.apache_license()[:1900]  # ~400 tokens: block 1 is partly filled
TOPICS = ["patents", "trademarks", "warranty", "liability", "redistribution", "notices"]
TOPICS += ["contributions", "derivative works", "sublicensing", "termination", "royalties", "support"]
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
        record = engine.admin.store.records.get(agent)
        assert record is not None
        written.append(reply.bytes_written)
        gained.append(len(record.token_ids) - before)
        before = len(record.token_ids)
    return prompt, written, gained


def _rows_written(ends: list[int]) -> list[int]:
    """The rows each turn after the first writes, from the tokens stored after each turn: a
    turn that fills its last block writes it whole (and what it adds after it); one that
    does not writes the rows since the whole prefix that block is stored from, or the block
    whole (then the prefix) where those rows would outnumber the prefix's."""
    rows, prefix = [], ends[0] % BLOCK_TOKENS  # turn 1 writes every block whole
    for before, after in itertools.pairwise(ends):
        start = before // BLOCK_TOKENS * BLOCK_TOKENS
        assert start > 0  # block 0 is full from turn 1 on (SYSTEM)
        n = after - start
        if n >= BLOCK_TOKENS or n - prefix > prefix:
            rows.append(n)
            prefix = after % BLOCK_TOKENS
        else:
            rows.append(n - prefix)
    return rows


def _files_of(store: DiskBlockStore, h: BlockHash) -> int:
    """The files block ``h`` is read from: itself, and those its segments continue."""
    files = 1
    while (h := store.blocks.prior_of(h)) is not None:  # type: ignore[assignment]
        files += 1
    return files


def _assert_full_blocks_whole(store: DiskBlockStore, record: AgentRecord) -> None:
    """Each full block of ``record``'s chain is one whole file, and the only segments the
    record names are the last, partly filled block's chain: a restore reads one file per
    full block."""
    full = len(record.token_ids) // BLOCK_TOKENS
    for h in record.chain[:full]:
        assert store.blocks.prior_of(h) is None and h not in record.priors, f"block {h[:12]} is a segment"
    last, parts = record.chain[-1], set()
    while last in record.priors:
        parts.add(last)
        last = record.priors[last]
    assert set(record.priors) == parts


@pytest.mark.parametrize("kv_bits", [None, 4])
def test_a_turn_writes_a_segment_since_its_blocks_prefix_a_block_it_fills_whole_and_reloads_like_hot(
    smollm: LoadedModel, tmp_path: Path, kv_bits: int | None
) -> None:
    hot = Engine("smollm2-135m", cache_dir=tmp_path, kv_bits=kv_bits)
    prompt, written, gained = _conversation(hot, "a", 7)
    store = hot.admin.store
    record = store.records.get("a")
    assert record is not None and len(record.token_ids) > 2 * BLOCK_TOKENS  # block 1 filled by turns
    assert record.priors  # ... and block 2 continued by a segment
    _assert_full_blocks_whole(store, record)
    # The segments block 1 was written in are gone: nothing names them.
    assert set(store.blocks.hashes()) == set(record.blocks)
    # Turns 2-7 write the rows ``_rows_written`` says, the same bytes per row whether as a
    # segment or whole (a rewrite of the whole block each turn: 3.5x the new tokens' K/V).
    rows = _rows_written(list(itertools.accumulate(gained)))
    per_row = {w / r for w, r in zip(written[1:], rows, strict=True)}
    assert len(per_row) == 1, (written, rows)
    assert written[0] >= gained[0] * min(per_row)  # turn 1: whole blocks (block 0's head at 16 bits)

    # Reload (a new engine: nothing in memory) continues token for token like the hot one.
    nxt = prompt + "\nQ9: Summarize it.\nA:"
    warm = Engine("smollm2-135m", cache_dir=tmp_path, kv_bits=kv_bits).generate("a", nxt, GREEDY)
    again = hot.generate("a", nxt, GREEDY)
    assert str(warm.outcome) == "warm-extend" and str(again.outcome) == "hot-extend"
    assert warm.reused_tokens == again.reused_tokens > 2 * BLOCK_TOKENS
    if kv_bits is None:  # at 16 bits the stored rows are the computed ones: equal to a cold run
        assert warm.text == again.text


def test_after_many_turns_no_block_is_read_from_more_than_one_segment_and_reload_is_the_hot_run(
    smollm: LoadedModel, tmp_path: Path
) -> None:
    """Twelve turns of ~25 tokens (block 1 filled, block 2 continued over seven turns): after
    every save each block of the record is one whole file, or its whole prefix and one
    segment (a segment a turn chained up to 7 of them late in a block's cycle, and the
    restore of each cost about what a whole block's does), the record names no other file
    and the directory holds no segment it dropped; a new engine then answers like the hot
    one."""
    hot = Engine("smollm2-135m", cache_dir=tmp_path, kv_bits=None)
    store, prompt = hot.admin.store, SYSTEM
    segments = 0
    for question in QUESTIONS:
        prompt += question
        prompt += hot.generate("a", prompt, GREEDY).text
        hot.flush()
        record = store.records.get("a")
        assert record is not None
        files = [_files_of(store, h) for h in record.chain]
        assert max(files) <= 2 and all(f == 1 for f in files[:-1]), files
        assert len(record.priors) == files[-1] - 1
        assert set(store.blocks.hashes()) == set(record.blocks)
        segments += files[-1] - 1
    assert record.token_ids[2 * BLOCK_TOKENS :] and segments >= 4  # the last block grew by segments

    nxt = prompt + "\nQ99: Summarize it.\nA:"
    warm = Engine("smollm2-135m", cache_dir=tmp_path, kv_bits=None).generate("a", nxt, GREEDY)
    again = hot.generate("a", nxt, GREEDY)
    assert str(warm.outcome) == "warm-extend" and str(again.outcome) == "hot-extend"
    assert warm.reused_tokens == again.reused_tokens == len(record.token_ids)
    assert warm.text == again.text  # at 16 bits the stored rows are the computed ones


def test_forks_and_sharers_keep_the_blocks_segments_continue(smollm: LoadedModel, tmp_path: Path) -> None:
    """The writer of the segments is deleted: a fork of it still reloads, because its record
    names the blocks under its last block's segment too; an agent that reused its full
    blocks by content (SHARED) reloads as well, and names no segment (they are whole)."""
    eng = Engine("smollm2-135m", cache_dir=tmp_path)
    prompt, _, _ = _conversation(eng, "writer", 7)
    eng.admin.fork("writer", "fork")
    shared = eng.generate("sharer", prompt + "\nQ7: Is it permissive?\nA:", GREEDY)
    eng.flush()
    assert shared.outcome.match is MatchKind.SHARED and shared.reused_tokens >= 2 * BLOCK_TOKENS
    assert eng.admin.delete("writer")
    store = eng.admin.store
    for agent in ("fork", "sharer"):
        record = store.records.get(agent)
        assert record is not None and bool(record.priors) == (agent == "fork")
        assert all(store.blocks.has(h) for h in record.blocks), agent
    fresh = Engine("smollm2-135m", cache_dir=tmp_path)
    for agent in ("fork", "sharer"):
        text = fresh.admin.cached_text(agent)
        again = fresh.generate(agent, text + " And?", GREEDY)
        assert str(again.outcome) == "warm-extend", agent


def test_a_filled_block_is_the_block_a_one_turn_save_of_its_text_writes_and_shares(
    smollm: LoadedModel, tmp_path: Path
) -> None:
    """The block a conversation filled turn by turn is the one a save of the same text in one
    turn writes (same hash, one whole file of the same size), and an agent that starts with
    that text reuses it by content, naming no segment of it."""
    eng = Engine("smollm2-135m", cache_dir=tmp_path / "turns")
    _conversation(eng, "a", 6)
    store = eng.admin.store
    record = store.records.get("a")
    assert record is not None
    full = len(record.token_ids) // BLOCK_TOKENS
    text, one = eng.admin.cached_text("a"), GenerationParams(max_tokens=1)
    whole = Engine("smollm2-135m", cache_dir=tmp_path / "whole")
    whole.generate("a", text, one)
    whole.flush()
    written = whole.admin.store.records.get("a")
    assert written is not None and written.chain[:full] == record.chain[:full]
    for h in record.chain[:full]:
        assert store.blocks.path(h).stat().st_size == whole.admin.store.blocks.path(h).stat().st_size

    shared = eng.generate("sharer", text, one)
    eng.flush()
    # (and past them the leading rows of the agent's last block: ``prefix_index``)
    assert shared.outcome.match is MatchKind.SHARED and shared.reused_tokens >= full * BLOCK_TOKENS
    sharer = store.records.get("sharer")
    assert sharer is not None and sharer.chain[:full] == record.chain[:full]
    _assert_full_blocks_whole(store, sharer)
    assert all(store.records.refcount(h) == 2 for h in record.chain[:full])


class _Crash(BaseException):
    """The process dies here: nothing after it runs (no handler of the save's catches it)."""


def test_a_crash_between_a_filled_blocks_write_and_its_record_leaves_the_last_save(
    smollm: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The save of the turn that fills block 1 writes that block whole, then dies before its
    record: the agent reloads as the turn before left it (its segments all there) and
    answers as the hot run did; the next save names the whole block written before the
    crash and releases the segments."""
    eng = Engine("smollm2-135m", cache_dir=tmp_path, kv_bits=None)
    store, crashed = eng.admin.store, []
    put_record = store.records.put

    def dies_filling_block_1(record: AgentRecord, *args: object) -> int:
        if len(record.token_ids) >= 2 * BLOCK_TOKENS:
            crashed.append(record)
            raise _Crash
        return put_record(record, *args)

    monkeypatch.setattr(store.records, "put", dies_filling_block_1)
    prompt = SYSTEM
    for question in QUESTIONS:
        prompt += question
        reply = eng.generate("a", prompt, GREEDY)
        with contextlib.suppress(_Crash):
            eng.flush()
        if crashed:
            break
        prompt += reply.text
    (record,) = crashed
    filled = record.chain[1]
    assert store.blocks.has(filled) and store.blocks.prior_of(filled) is None  # written whole, durable
    last = store.records.get("a")
    assert last is not None and len(last.token_ids) < 2 * BLOCK_TOKENS and last.priors
    monkeypatch.undo()
    eng.close()

    fresh = Engine("smollm2-135m", cache_dir=tmp_path, kv_bits=None)
    again = fresh.generate("a", prompt, GREEDY)
    assert str(again.outcome) == "warm-extend" and again.reused_tokens == len(last.token_ids)
    assert again.text == reply.text  # at 16 bits the stored rows are the computed ones
    fresh.flush()
    healed = fresh.admin.store.records.get("a")
    assert healed is not None and healed.chain[1] == filled
    _assert_full_blocks_whole(fresh.admin.store, healed)
    assert set(fresh.admin.store.blocks.hashes()) == set(healed.blocks)


def test_a_damaged_block_under_a_segment_costs_a_prefill_and_the_next_save_mends_it(
    smollm: LoadedModel, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    eng = Engine("smollm2-135m", cache_dir=tmp_path)
    prompt, _, _ = _conversation(eng, "a", 3)
    record = eng.admin.store.records.get("a")
    assert record is not None and record.priors
    base = next(p for p in record.priors.values() if p not in record.priors)  # block 1's first part
    path = eng.admin.store.blocks.path(base)
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
    mended = fresh.admin.store.records.get("a")
    assert mended is not None and all(fresh.admin.store.blocks.has(h) for h in mended.blocks)
    last = Engine("smollm2-135m", cache_dir=tmp_path).generate("a", nxt + again.text + " More?", GREEDY)
    assert str(last.outcome) == "warm-extend"


def test_another_worker_reads_a_segmented_chain_through_the_shared_store(
    smollm: LoadedModel, shared_store: tuple[str, str], tmp_path: Path
) -> None:
    """Worker A's turns leave segments; worker B (its own empty cache directory) fetches the
    chain from the store with the blocks its segments continue, and answers like A."""
    store, blocks = shared_store
    with Engine("smollm2-135m", cache_dir=tmp_path / "a", kv_bits=None, store=store, blocks=blocks) as a:
        prompt, _, _ = _conversation(a, "agent", 3)  # block 1 not filled
        record = a.admin.store.records.get("agent")
        assert record is not None and record.priors
        nxt = prompt + "\nQ8: Anything else?\nA:"
        hot = a.generate("agent", nxt, GREEDY)
    with Engine("smollm2-135m", cache_dir=tmp_path / "b", kv_bits=None, store=store, blocks=blocks) as b:
        stored = b.admin.store.records.get("agent")  # A's last save, a segment and its prefix
        assert stored is not None and stored.priors and stored.chain[-1] != record.chain[-1]
        turn = b.generate("agent", nxt + hot.text + "\nQ9: Why?\nA:", GREEDY)
        assert str(turn.outcome) == "warm-extend" and turn.reused_tokens == len(stored.token_ids)
