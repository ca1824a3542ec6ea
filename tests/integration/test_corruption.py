"""Damaged caches on the real default model: a truncated block, flipped bits in a block's
tensor data and in its header, a block from a future format version, another model's
block under the right name, a corrupt or unknown-version agent record. Each is detected
(checksum, hash, fingerprint, version), the bad file is moved to ``quarantine/``, the agent
falls back to a full prefill (same greedy output) with one log line that names it, and the
next save repairs the cache (a new engine then resumes it from disk)."""

from __future__ import annotations

import json
import logging
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest

from langchain_agent_memory import corpus
from langchain_agent_memory.engine.engine import Engine, GenerationParams, GenerationResult
from langchain_agent_memory.engine.model.loading import LoadedModel
from langchain_agent_memory.engine.ops.runtime import mx
from langchain_agent_memory.engine.storage.blocks import Block
from langchain_agent_memory.engine.storage.store import DiskBlockStore

GREEDY = GenerationParams(max_tokens=8)
PROMPT = (
    "You answer questions about this license.\n\n" + corpus.apache_license()[:1500] + "\n\nQ: Its name?\nA:"
)


def _flip(offset: int) -> Callable[[Path, Engine], None]:
    def damage(path: Path, _: Engine) -> None:
        data = bytearray(path.read_bytes())
        data[offset] ^= 0x5A
        path.write_bytes(bytes(data))

    return damage


def _flip_header(path: Path, _: Engine) -> None:
    data = bytearray(path.read_bytes())
    at = data.index(b'"checksum"') + len(b'"checksum":"') + 5  # a hex digit of the checksum
    data[at] = ord("0") if data[at] != ord("0") else ord("1")
    path.write_bytes(bytes(data))


def _truncate(path: Path, _: Engine) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])


def _rewrite_header(path: Path, **changes: str) -> None:
    tensors, meta = mx.load(str(path), return_metadata=True)
    path.unlink()
    mx.save_safetensors(str(path), tensors, metadata={**meta, **changes})


def _future_version(path: Path, _: Engine) -> None:
    _rewrite_header(path, format_version="2")


def _other_models_block(path: Path, engine: Engine) -> None:
    """The same block, as another model's (or KV format's) cache directory holds it."""
    good = engine.admin.store.blocks.get(path.stem)  # type: ignore[arg-type]
    other = DiskBlockStore(engine.cache_dir / "kv", "another-model")
    other.blocks.put(Block(good.hash, good.parent, good.token_ids, good.tensors))
    path.write_bytes(other.blocks.path(good.hash).read_bytes())


BLOCK_DAMAGE = {
    "truncated": _truncate,
    "tensor-bits": _flip(-100),
    "header-bits": _flip_header,
    "future-version": _future_version,
    "other-model": _other_models_block,
}


_REPAIRED: list[str] = []


def _record_figure(figures: dict[str, str], damage: str) -> None:
    _REPAIRED.append(damage)
    figures["corruption"] = (
        f"{len(_REPAIRED)} damaged caches ({', '.join(_REPAIRED)}): {len(_REPAIRED)} detected, "
        f"{len(_REPAIRED)} quarantined, {len(_REPAIRED)} fallbacks to prefill (one log line each), "
        f"{len(_REPAIRED)} repaired by the next save"
    )


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and r.name.startswith("langchain_agent_memory")
    ]


@pytest.mark.parametrize("damage", BLOCK_DAMAGE, ids=str)
def test_damaged_block_is_quarantined_and_repaired(
    damage: str,
    smollm: LoadedModel,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    figures: dict[str, str],
) -> None:
    engine = Engine("smollm2-135m", cache_dir=tmp_path)
    first = engine.generate("lawyer", PROMPT, GREEDY)
    record = engine.admin.store.records.get("lawyer")
    assert record is not None and len(record.blocks) >= 2
    victim = engine.admin.store.blocks.path(record.blocks[1])
    BLOCK_DAMAGE[damage](victim, engine)

    again = _falls_back_then_repairs(tmp_path, first, caplog)
    # Only blocks before the damaged one can serve (shared by content), never the damaged one.
    assert again.reused_tokens <= 256
    Engine("smollm2-135m", cache_dir=tmp_path).admin.store.blocks.get(record.blocks[1])  # a sound copy
    _record_figure(figures, damage)


def _falls_back_then_repairs(
    tmp_path: Path, first: GenerationResult, caplog: pytest.LogCaptureFixture
) -> GenerationResult:
    """A new process meets the damage: one log line, the bad file aside, a prefill with the
    same answer; the one after it resumes the repaired cache from disk."""
    restarted = Engine("smollm2-135m", cache_dir=tmp_path)
    with caplog.at_level(logging.WARNING):
        again = restarted.generate("lawyer", PROMPT, GREEDY)
    assert again.text == first.text  # prefilled again, the same answer
    assert str(again.outcome) in ("cold", "warm-shared", "hot-shared")  # sound shared blocks may serve
    (line,) = _warnings(caplog)
    assert "'lawyer'" in line and "falling back to prefill" in line and "quarantine" in line
    assert len(list((restarted.admin.store.dir / "quarantine").iterdir())) == 1  # kept aside, not deleted
    repaired = Engine("smollm2-135m", cache_dir=tmp_path)
    third = repaired.generate("lawyer", PROMPT, GREEDY)
    assert str(third.outcome).startswith("warm") and third.text == first.text  # from disk again
    assert third.reused_tokens >= third.prompt_tokens - 2  # (the kept reply makes it "diverge")
    return again


def _edit_record(engine: Engine, edit: Callable[[str], str]) -> None:
    index = sqlite3.connect(engine.admin.store.dir / "index.sqlite")
    (raw,) = index.execute("SELECT record FROM agents WHERE agent_id = 'lawyer'").fetchone()
    index.execute("UPDATE agents SET record = ? WHERE agent_id = 'lawyer'", (edit(raw),))
    index.commit()
    index.close()


RECORD_DAMAGE = {
    "record-bits": lambda raw: raw[:40] + "\x00" + raw[41:],
    "record-unknown-version": lambda raw: json.dumps({**json.loads(raw), "format_version": 0}),
}


@pytest.mark.parametrize("damage", RECORD_DAMAGE, ids=str)
def test_damaged_record_is_quarantined_and_repaired(
    damage: str,
    smollm: LoadedModel,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    figures: dict[str, str],
) -> None:
    engine = Engine("smollm2-135m", cache_dir=tmp_path)
    first = engine.generate("lawyer", PROMPT, GREEDY)
    _edit_record(engine, RECORD_DAMAGE[damage])
    _falls_back_then_repairs(tmp_path, first, caplog)
    _record_figure(figures, damage)
