"""Fuzzing (hypothesis) of what comes from outside: agent ids, block hashes, block file
headers and bodies, agent records and the directory's format file. No input may name a
path outside the cache directory, and parsing may only ever end in a result or in
``CacheFormatError`` / ``ValueError``: never another exception, never a crash."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from langchain_agent_memory.engine.ops.runtime import mx
from langchain_agent_memory.engine.storage.agent_ids import validate_agent_id
from langchain_agent_memory.engine.storage.blocks import AgentRecord, Block, CacheFormatError, block_hash
from langchain_agent_memory.engine.storage.store import DiskBlockStore

FP = "fuzz-model"
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
COUNTS: dict[str, int] = {}


def _count(name: str) -> None:
    COUNTS[name] = COUNTS.get(name, 0) + 1


@pytest.fixture(scope="module", autouse=True)
def _report(figures: dict[str, str]) -> Iterator[None]:
    """What this module's fuzzers saw, in the run's figures (whatever order they ran in)."""
    yield
    if COUNTS:
        figures["fuzzing"] = ", ".join(f"{v} {k}" for k, v in sorted(COUNTS.items())) + ", 0 crashes"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> DiskBlockStore:
    return DiskBlockStore(tmp_path_factory.mktemp("fuzz"), FP)


def _files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file() and "index.sqlite" not in p.name}


@FUZZ
@given(agent_id=st.text(min_size=0, max_size=300))
def test_no_agent_id_names_a_path(store: DiskBlockStore, agent_id: str) -> None:
    before = _files(store.dir.parent)
    try:
        validate_agent_id(agent_id)
    except ValueError:
        with pytest.raises(ValueError, match="agent_id"):
            store.records.put(AgentRecord(agent_id, [], [1], [1], "x"))
        _count("agent ids refused")
        return
    store.records.put(AgentRecord(agent_id, [], [1], [1], "x"))
    assert store.records.get(agent_id).agent_id == agent_id  # type: ignore[union-attr]
    assert store.maintenance.quarantine_agent(agent_id) is not None  # the one place an id reaches a file name
    quarantined = _files(store.dir.parent) - before
    assert all(p.parent == store.dir / "quarantine" for p in quarantined)
    for p in quarantined:
        p.unlink()
    _count("agent ids stored")


@FUZZ
@given(h=st.text(max_size=80))
def test_no_block_hash_names_a_path(store: DiskBlockStore, h: str) -> None:
    try:
        path = store.blocks.path(h)  # type: ignore[arg-type]
    except ValueError:
        _count("block names refused")
        return
    assert path.parent.parent == store.blocks.dir


def _good_block_bytes(store: DiskBlockStore) -> tuple[str, bytes, dict[str, mx.array]]:
    h = block_hash(None, [1, 2, 3], FP)
    tensors = {"L0.k.q": mx.arange(24, dtype=mx.uint32).reshape(1, 1, 3, 8), "L0.v": mx.ones((1, 1, 3, 4))}
    store.blocks.delete(h)  # the previous example left a damaged copy
    store.blocks.put(Block(h, None, [1, 2, 3], tensors))
    return h, store.blocks.path(h).read_bytes(), tensors


def test_damaged_block_files_are_refused_cleanly(store: DiskBlockStore, figures: dict[str, str]) -> None:
    seen: dict[str, int] = {}

    @FUZZ
    @given(data=st.data())
    def damage(data: st.DataObject) -> None:
        h, good, tensors = _good_block_bytes(store)
        (n,) = struct.unpack("<Q", good[:8])
        kind = data.draw(st.sampled_from(["header-bytes", "length", "json", "truncate", "body-bytes"]))
        raw = bytearray(good)
        if kind == "header-bytes":
            for at in data.draw(st.lists(st.integers(8, 8 + n - 1), min_size=1, max_size=8)):
                raw[at] = data.draw(st.integers(0, 255))
        elif kind == "length":
            raw[:8] = struct.pack("<Q", data.draw(st.integers(0, 2**64 - 1)))
        elif kind == "json":
            header = data.draw(
                st.recursive(
                    st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                    lambda inner: (
                        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
                    ),
                    max_leaves=20,
                )
            )
            encoded = json.dumps(header).encode()
            raw = bytearray(struct.pack("<Q", len(encoded)) + encoded + good[8 + n :])
        elif kind == "truncate":
            raw = raw[: data.draw(st.integers(0, len(good) - 1))]
        else:
            for at in data.draw(st.lists(st.integers(8 + n, len(good) - 1), min_size=1, max_size=8)):
                raw[at] ^= data.draw(st.integers(1, 255))
        store.blocks.path(h).write_bytes(bytes(raw))  # type: ignore[arg-type]
        try:
            block = store.blocks.get(h)  # type: ignore[arg-type]
        except CacheFormatError:
            seen["refused"] = seen.get("refused", 0) + 1
            return
        # Accepted only if what it holds is what was written (e.g. a byte set to its value).
        assert block.token_ids == [1, 2, 3] and block.parent is None
        assert sorted(block.tensors) == sorted(tensors)
        for name, x in tensors.items():
            got = block.tensors[name]
            assert got.dtype == x.dtype and mx.array_equal(got, x).item(), name
        seen["unchanged"] = seen.get("unchanged", 0) + 1

    damage()
    # Every kind of damage but a byte set to the value it had must be refused: most are.
    assert seen.get("refused", 0) >= 100, seen
    refused, same = seen.get("refused", 0), seen.get("unchanged", 0)
    figures["fuzzing: block files"] = f"{refused} damaged refused, {same} unchanged accepted"


@FUZZ
@given(raw=st.one_of(st.text(max_size=300), st.binary(max_size=300).map(lambda b: b.decode("latin-1"))))
def test_damaged_records_are_refused_cleanly(store: DiskBlockStore, raw: str) -> None:
    store.records.put(AgentRecord("victim", [], [], [], ""))
    import sqlite3

    db = sqlite3.connect(store.dir / "index.sqlite")
    db.execute("UPDATE agents SET record = ? WHERE agent_id = 'victim'", (raw,))
    db.commit()
    db.close()
    try:
        store.records.get("victim")
        _count("records parsed")
    except CacheFormatError:
        _count("damaged records refused")


_VALUES = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=8)
    | st.lists(st.integers(), max_size=4)
)


@FUZZ
@given(
    fields=st.fixed_dictionaries(
        {},
        optional={
            "format_version": st.just(1) | _VALUES,
            "agent_id": st.just("victim") | _VALUES,
            "blocks": _VALUES,
            "token_ids": _VALUES,
            "token_ends": _VALUES,
            "text": _VALUES,
            "updated_at": _VALUES,
        },
    )
)
def test_records_of_the_wrong_shape_are_refused(store: DiskBlockStore, fields: dict) -> None:
    try:
        record = AgentRecord.from_json(json.dumps(fields))
    except CacheFormatError:
        _count("malformed records refused")
        return
    assert isinstance(record.text, str) and len(record.token_ids) == len(record.token_ends)
    _count("records parsed")


@settings(max_examples=100, deadline=None)
@given(raw=st.binary(max_size=200))
def test_damaged_format_file_is_refused_cleanly(tmp_path_factory: pytest.TempPathFactory, raw: bytes) -> None:
    root = tmp_path_factory.mktemp("fmt")
    (root / FP).mkdir()
    (root / FP / "format.json").write_bytes(raw)
    try:
        DiskBlockStore(root, FP)
    except CacheFormatError:
        _count("damaged format files refused")
