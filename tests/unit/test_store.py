"""DiskBlockStore: content-addressed immutable blocks, atomic agent records, and refusals
of corrupt, truncated, foreign or newer files (real files, no model)."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import numpy as np
import pytest

from langchain_agent_memory.engine.ops.runtime import mx
from langchain_agent_memory.engine.storage import checksums, gather, reader
from langchain_agent_memory.engine.storage.agent_ids import validate_agent_id
from langchain_agent_memory.engine.storage.blocks import (
    FORMAT_VERSION,
    SEGMENTS_FORMAT_VERSION,
    AgentRecord,
    Block,
    BlockMissingError,
    CacheFormatError,
    NewerFormatError,
    block_hash,
)
from langchain_agent_memory.engine.storage.checksums import covered, fast_checksum, part_checksums
from langchain_agent_memory.engine.storage.index import INDEX_SCHEMA_VERSION
from langchain_agent_memory.engine.storage.reader import TensorEntry
from langchain_agent_memory.engine.storage.store import DiskBlockStore

FP = "model-a"


def _block(parent=None, tokens=(1, 2, 3), fp=FP, seed=0) -> Block:
    mx.random.seed(seed)
    tensors = {
        "L0.k.q": mx.random.randint(0, 2**31, (1, 1, len(tokens), 8)).astype(mx.uint32),
        "L0.k.scales": mx.random.normal((1, 1, len(tokens), 1)).astype(mx.float16),
        "L0.v": mx.random.normal((1, 1, len(tokens), 64)).astype(mx.bfloat16),
    }
    return Block(block_hash(parent, list(tokens), fp), parent, list(tokens), tensors)


def test_hash_is_chained_and_model_specific() -> None:
    a = block_hash(None, [1, 2, 3], FP)
    assert a == block_hash(None, [1, 2, 3], FP)  # stable: no per-process seed
    assert a != block_hash(None, [1, 2, 4], FP)
    assert a != block_hash(None, [1, 2, 3], "model-b")
    assert block_hash(a, [5], FP) != block_hash(block_hash(None, [9], FP), [5], FP)


def test_round_trip_and_immutability(tmp_path: Path) -> None:
    store = DiskBlockStore(tmp_path, FP)
    blk = _block()
    written = store.blocks.put(blk)
    assert written > blk.nbytes  # tensors + header
    assert store.blocks.put(blk) == 0  # content-addressed: never rewritten
    back = store.blocks.get(blk.hash)
    assert back.token_ids == [1, 2, 3] and back.parent is None
    for k, v in blk.tensors.items():
        assert back.tensors[k].dtype == v.dtype
        assert mx.array_equal(back.tensors[k], v).item()
    assert list(store.blocks.hashes()) == [blk.hash]
    assert not list(tmp_path.rglob("*.tmp")) and not list(tmp_path.rglob(".*.safetensors"))


def _corrupt(path: Path, offset_from_end: int) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0xFF
    path.write_bytes(bytes(data))


def test_flipped_tensor_bit_is_detected(tmp_path: Path) -> None:
    store = DiskBlockStore(tmp_path, FP)
    blk = _block()
    store.blocks.put(blk)
    _corrupt(store.blocks.path(blk.hash), 3)
    with pytest.raises(CacheFormatError, match="checksum"):
        store.blocks.get(blk.hash)


def test_truncated_block_is_detected(tmp_path: Path) -> None:
    store = DiskBlockStore(tmp_path, FP)
    blk = _block()
    store.blocks.put(blk)
    path = store.blocks.path(blk.hash)
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(CacheFormatError, match="unreadable"):
        store.blocks.get(blk.hash)


def test_flipped_header_byte_is_detected(tmp_path: Path) -> None:
    store = DiskBlockStore(tmp_path, FP)
    blk = _block()
    store.blocks.put(blk)
    path = store.blocks.path(blk.hash)
    data = bytearray(path.read_bytes())
    i = data.index(b'"token_ids"') + 16  # inside the header's JSON text
    data[i] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CacheFormatError):
        store.blocks.get(blk.hash)


def test_another_models_block_under_the_right_name(tmp_path: Path) -> None:
    mine = DiskBlockStore(tmp_path, FP)
    theirs = DiskBlockStore(tmp_path, "model-b")
    blk = _block(fp="model-b")
    theirs.blocks.put(blk)
    target = mine.blocks.path(blk.hash)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(theirs.blocks.path(blk.hash).read_bytes())
    with pytest.raises(CacheFormatError, match="another model"):
        mine.blocks.get(blk.hash)


def test_missing_block(tmp_path: Path) -> None:
    with pytest.raises(BlockMissingError):
        DiskBlockStore(tmp_path, FP).blocks.get(block_hash(None, [7], FP))


def test_newer_format_directory_is_refused(tmp_path: Path) -> None:
    DiskBlockStore(tmp_path, FP)
    (tmp_path / FP / "format.json").write_text(json.dumps({"format_version": FORMAT_VERSION + 1}))
    with pytest.raises(CacheFormatError, match=r"newer langchain-agent-memory.*upgrade"):
        DiskBlockStore(tmp_path, FP)


def test_agent_records_round_trip(tmp_path: Path) -> None:
    store = DiskBlockStore(tmp_path, FP)
    rec = AgentRecord("thread-1:planner", [block_hash(None, [1], FP)], [1], [3], "abc")
    store.records.put(rec)
    back = store.records.get("thread-1:planner")
    assert back is not None and back.blocks == rec.blocks and back.text == "abc"
    assert store.records.get("other") is None
    assert [r.agent_id for r in store.records.list()] == ["thread-1:planner"]
    assert store.records.delete("thread-1:planner") and store.records.get("thread-1:planner") is None


def _edit_record(store: DiskBlockStore, agent_id: str, edit) -> None:  # type: ignore[no-untyped-def]
    """Change a stored record in the index file, as another version (or damage) would."""
    db = sqlite3.connect(store.dir / "index.sqlite")
    (raw,) = db.execute("SELECT record FROM agents WHERE agent_id = ?", (agent_id,)).fetchone()
    db.execute("UPDATE agents SET record = ? WHERE agent_id = ?", (edit(raw), agent_id))
    db.commit()
    db.close()


def test_newer_agent_record_is_refused(tmp_path: Path) -> None:
    store = DiskBlockStore(tmp_path, FP)
    store.records.put(AgentRecord("a", [], [], [], ""))
    _edit_record(
        store, "a", lambda raw: json.dumps({**json.loads(raw), "format_version": SEGMENTS_FORMAT_VERSION + 1})
    )
    with pytest.raises(CacheFormatError, match="newer"):
        store.records.get("a")


def test_corrupt_agent_record_is_a_format_error(tmp_path: Path) -> None:
    store = DiskBlockStore(tmp_path, FP)
    store.records.put(AgentRecord("a", [], [], [], ""))
    _edit_record(store, "a", lambda raw: raw[: len(raw) // 2])
    with pytest.raises(CacheFormatError, match="corrupt"):
        store.records.get("a")
    assert list(store.records.list()) == []  # listing skips it (with a log line)


def test_open_removes_temp_files_and_unreferenced_blocks(tmp_path: Path) -> None:
    store = DiskBlockStore(tmp_path, FP)
    kept, orphan = _block(tokens=(1,)), _block(tokens=(2,))
    store.blocks.put(kept)
    store.blocks.put(orphan)  # a save killed before its record was written
    store.records.put(AgentRecord("a", [kept.hash], [1], [1], "x"))
    temp = store.blocks.path(kept.hash).parent / f".{kept.hash}.safetensors.abc.safetensors"
    temp.write_bytes(b"half a block")  # a save killed mid-write
    report = DiskBlockStore(tmp_path, FP).recovery
    assert (report.temp_files_removed, report.orphan_blocks_removed, report.missing_blocks) == (1, 1, 0)
    assert not temp.exists() and not store.blocks.has(orphan.hash) and store.blocks.has(kept.hash)


def test_records_of_the_json_layout_are_migrated(tmp_path: Path) -> None:
    legacy = tmp_path / FP / "agents"
    legacy.mkdir(parents=True)
    (legacy / "0123.json").write_text(AgentRecord("old-agent", [], [5], [1], "x").to_json())
    store = DiskBlockStore(tmp_path, FP)
    assert store.recovery.records_migrated == 1 and not legacy.exists()
    assert store.records.get("old-agent") is not None


@pytest.mark.parametrize("bad", ["", "../x", "a/b", "a\\b", "a\x00b", ".hidden", "x" * 257, "tab\there"])
def test_bad_agent_ids_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="agent_id"):
        validate_agent_id(bad)


@pytest.mark.parametrize(
    "good", ["researcher", "thread-1:planner|sub", "user 42", "é-agent", "x" * 256, "a'; DROP"]
)
def test_good_agent_ids_round_trip_and_name_no_file(good: str, tmp_path: Path) -> None:
    store = DiskBlockStore(tmp_path, FP)
    before = {p.name for p in (tmp_path / FP).iterdir()}
    store.records.put(AgentRecord(good, [], [1], [1], "x"))
    assert store.records.get(good).agent_id == good  # type: ignore[union-attr]
    assert {p.name for p in (tmp_path / FP).iterdir()} == before  # only the index changed


def test_index_schema_is_versioned_and_migrated(tmp_path: Path) -> None:
    store = DiskBlockStore(tmp_path, FP)
    rec = AgentRecord("a", [], [1, 2], [1, 2], "hi")
    store.records.put(rec)
    store.close()
    db = sqlite3.connect(tmp_path / FP / "index.sqlite")
    assert db.execute("PRAGMA user_version").fetchone()[0] == INDEX_SCHEMA_VERSION
    # An index written before versioning (user_version 0, same tables) is migrated in place.
    db.execute("PRAGMA user_version = 0")
    db.commit()
    again = DiskBlockStore(tmp_path, FP)
    assert again.records.get("a") == rec
    again.close()
    assert db.execute("PRAGMA user_version").fetchone()[0] == INDEX_SCHEMA_VERSION
    # A newer version's index is refused, not rewritten.
    db.execute(f"PRAGMA user_version = {INDEX_SCHEMA_VERSION + 1}")
    db.commit()
    with pytest.raises(NewerFormatError, match="upgrade the package"):
        DiskBlockStore(tmp_path, FP)
    assert db.execute("PRAGMA user_version").fetchone()[0] == INDEX_SCHEMA_VERSION + 1


def _layered_block(layers: int = 3, seed: int = 0) -> Block:
    mx.random.seed(seed)
    tensors = {}
    for i in (*range(layers), 10):  # L10 sorts between L1 and L2: ranges still per layer
        tensors[f"L{i}.k.q"] = mx.random.randint(0, 2**31, (1, 1, 4, 8)).astype(mx.uint32)
        tensors[f"L{i}.v"] = mx.random.normal((1, 1, 4, 16)).astype(mx.float16)
    return Block(block_hash(None, [1, 2, 3, 4], FP), None, [1, 2, 3, 4], tensors)


def test_some_layers_are_read_alone_and_checked_alone(tmp_path: Path) -> None:
    store = DiskBlockStore(tmp_path, FP)
    blk = _layered_block()
    store.blocks.put(blk)
    (whole,) = store.blocks.read([blk.hash])
    (part,) = store.blocks.read([blk.hash], layers=[0, 10])
    assert part.names() == ["L0.k.q", "L0.v", "L10.k.q", "L10.v"]
    assert part.blob.size == whole.blob.size // 2  # 2 of 4 layers: only their bytes were read
    for name in part.names():
        assert mx.array_equal(part.tensor(name), blk.tensors[name]).item()
    # A flipped bit in a layer that is read is caught; one in a layer that is not, is not
    # read (a whole read still catches it).
    path = store.blocks.path(blk.hash)
    data = bytearray(path.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    table = json.loads(data[8 : 8 + header_len])
    at = 8 + header_len + table["L2.v"]["data_offsets"][0]
    data[at] ^= 0x40
    path.write_bytes(bytes(data))
    store.blocks.read([blk.hash], layers=[0])  # L2 not read: nothing to check
    with pytest.raises(CacheFormatError, match="checksum"):
        store.blocks.read([blk.hash], layers=[2])
    with pytest.raises(CacheFormatError, match="checksum"):
        store.blocks.read([blk.hash])


def test_blocks_without_part_checksums_are_read_whole(tmp_path: Path) -> None:
    """A block written before per-layer checksums (same format version) still loads: whole."""
    store = DiskBlockStore(tmp_path, FP)
    blk = _layered_block()
    store.blocks.put(blk)
    path = store.blocks.path(blk.hash)
    (meta_back,) = [json.loads(path.read_bytes()[8 : 8 + int.from_bytes(path.read_bytes()[:8], "little")])]
    meta = meta_back["__metadata__"]
    for field in ("part_checksums", "xxh3", "part_xxh3"):  # none of them was written then
        del meta[field]
    mx.save_safetensors(str(path), dict(blk.tensors), metadata=meta)
    (group,) = store.blocks.read([blk.hash], layers=[0])
    assert len(group.names()) == len(blk.tensors)


def _meta(path: Path) -> dict[str, str]:
    data = path.read_bytes()
    return json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])["__metadata__"]


def test_the_fast_checksum_is_pinned() -> None:
    """XXH3-128 over the covered header fields, then (name, NUL, bytes) in name order: every
    reader must agree with every writer, of every version."""
    named = [("L0.v", b"\x01\x02\x03"), ("L0.k", b"abc")]
    assert fast_checksum(named, meta=b'{"hash":"x"}') == "277d3144ba9da95aece61b8b85d344df"
    assert fast_checksum(named) == "b82520d1777c65148d4a32ecb641462d"
    data = b"\x01\x02\x03abc"  # the same input, gathered into one buffer first
    entries = [TensorEntry("L0.v", "U8", (3,), 0, 3), TensorEntry("L0.k", "U8", (3,), 3, 6)]
    with gather.gathered(data, entries) as stream:
        assert stream is not None and bytes(stream) == b"L0.k\x00abcL0.v\x00\x01\x02\x03"
        gathered = checksums.Gathered(stream)
        assert fast_checksum(gathered, meta=b'{"hash":"x"}') == "277d3144ba9da95aece61b8b85d344df"
        with pytest.raises(TypeError):
            part_checksums(gathered)
    # The memory file is kept for the next block, until an engine closes (``release``).
    assert gather._kept()
    gather.release()
    assert not gather._kept()
    with gather.gathered(data, entries) as stream:
        assert stream is not None and bytes(stream) == b"L0.k\x00abcL0.v\x00\x01\x02\x03"


def test_a_restore_checks_the_fast_checksum_and_older_blocks_their_sha256(
    tmp_path: Path, digests: str
) -> None:
    """New blocks carry SHA-256 (for readers that know only it) and XXH3-128 (what a read
    checks, covering the other header fields too); a block written before XXH3 was added is
    checked by its SHA-256, whole or by layer, and still refused when damaged."""
    store = DiskBlockStore(tmp_path, FP)
    blk = _layered_block(seed=4)
    store.blocks.put(blk)
    path = store.blocks.path(blk.hash)
    meta = _meta(path)
    assert {"checksum", "part_checksums", "xxh3", "part_xxh3"} <= set(meta)
    (group,) = store.blocks.read([blk.hash])
    named = [(e.name, bytes(np.asarray(group.blob[0, e.begin : e.end]))) for e in group.headers[0].tensors]
    assert meta["xxh3"] == fast_checksum(named, meta=covered(meta, whole=True))
    for field in ("xxh3", "part_xxh3"):
        del meta[field]
    mx.save_safetensors(str(path), dict(blk.tensors), metadata=meta)
    (whole,) = store.blocks.read([blk.hash])
    (part,) = store.blocks.read([blk.hash], layers=[1])
    assert mx.array_equal(part.tensor("L1.v"), blk.tensors["L1.v"]).item() and whole.names() == sorted(
        blk.tensors
    )
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(CacheFormatError, match="checksum"):
        store.blocks.read([blk.hash])


@pytest.fixture(params=["tensor by tensor", "gathered"])
def digests(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """A whole block's digests taken tensor by tensor (this machine's few reader threads) or
    over its digest input gathered first (``gather``: what 4 or more reader threads do)."""
    monkeypatch.setattr(reader, "GATHER_THREADS", 0 if request.param == "gathered" else 1 << 10)
    return str(request.param)


def test_every_damaged_byte_of_a_block_file_is_refused(tmp_path: Path, digests: str) -> None:
    """A byte flipped anywhere in a block file (its header's fields, SHA-256 digests
    included, its tensor table, its data) is refused on a whole read: the fast checksum
    covers the header's fields as well as the data."""
    store = DiskBlockStore(tmp_path, FP)
    blk = _block(tokens=(5, 6, 7, 8), seed=9)
    store.blocks.put(blk)
    path = store.blocks.path(blk.hash)
    good = path.read_bytes()
    header_end = 8 + int.from_bytes(good[:8], "little")
    missed = []
    for at in [*range(0, header_end), *range(header_end, len(good), 7)]:
        if good[at : at + 1] == b" ":  # the header's padding: no field, nothing to damage
            continue
        data = bytearray(good)
        data[at] ^= 0x01
        path.write_bytes(bytes(data))
        try:
            store.blocks.get(blk.hash)
        except CacheFormatError:
            continue
        missed.append(at)
    path.write_bytes(good)
    assert store.blocks.get(blk.hash).hash == blk.hash
    assert missed == [], [good[max(0, a - 20) : a + 20] for a in missed[:5]]


def test_a_segment_holds_its_new_rows_and_reads_back_whole(tmp_path: Path) -> None:
    """A block written as a segment (``rows_from``) stores only its new rows, and continues
    the stored block of its first rows: reading it gives the whole block's tensors."""
    store = DiskBlockStore(tmp_path, FP)
    parent = _block(tokens=(7,) * 4, seed=1)
    store.blocks.put(parent)
    tokens = list(range(40))
    full = _block(parent.hash, tokens, seed=2)
    first = Block(block_hash(parent.hash, tokens[:10], FP), parent.hash, tokens[:10],
                  {k: v[:, :, :10] for k, v in full.tensors.items()})  # fmt: skip
    middle = Block(block_hash(parent.hash, tokens[:25], FP), parent.hash, tokens[:25],
                   {k: v[:, :, :25] for k, v in full.tensors.items()}, rows_from=10)  # fmt: skip
    store.blocks.put(first)
    store.blocks.put(middle)
    full.rows_from = 25
    written = store.blocks.put(full)
    assert written < store.blocks.put(Block(block_hash(None, tokens, FP), None, tokens, full.tensors)) * 0.5
    back = store.blocks.get(full.hash)
    assert back.rows_from == 25 and store.blocks.prior_of(full.hash) == middle.hash
    for k, v in full.tensors.items():
        assert mx.array_equal(back.tensors[k], v).item(), k
    (group,) = store.blocks.read([full.hash])
    assert all(mx.array_equal(group.tensor(k), v).item() for k, v in full.tensors.items())
    # Its first rows gone: the segment cannot be read, and says so as a damaged block.
    store.blocks.delete(first.hash)
    with pytest.raises(CacheFormatError, match="continues block"):
        store.blocks.get(full.hash)


def test_a_record_with_segments_round_trips_and_keeps_its_chain() -> None:
    chain = [block_hash(None, [i], FP) for i in range(3)]
    state = block_hash(chain[2], [0xFFFFFFFF], FP)
    p1, p2 = block_hash(None, [9], FP), block_hash(None, [8], FP)
    record = AgentRecord("a", [*chain, state], [1, 2, 3], [1, 2, 3], "abc", states=[3])
    record.set_priors({chain[2]: p1, p1: p2})
    assert record.chain == chain and record.state_blocks() == {3: state} and record.blocks[-2:] == [p1, p2]
    back = AgentRecord.from_json(record.to_json())
    assert json.loads(record.to_json())["format_version"] == SEGMENTS_FORMAT_VERSION
    assert back.chain == chain and back.priors == record.priors and back.blocks == record.blocks
    assert "token_ids" not in json.loads(record.to_json())  # packed: rewritten by every turn
    forged = json.loads(record.to_json())
    forged["blocks"] = forged["blocks"][:-1]  # a predecessor it does not list
    with pytest.raises(CacheFormatError, match="segment"):
        AgentRecord.from_json(json.dumps(forged))
    damaged = json.loads(record.to_json())
    damaged["packed"] = damaged["packed"][:-8]
    with pytest.raises(CacheFormatError, match="packed tokens"):
        AgentRecord.from_json(json.dumps(damaged))
