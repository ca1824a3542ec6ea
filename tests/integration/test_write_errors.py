"""A full disk or a permission error during a save (injected at the file layer, and on a
real filesystem filled to its last byte: a small tmpfs): the reply leaves before its save (written on
the engine's save thread), and the error reaches the caller at ``flush`` with a message
that says what happened and what to do, the previous cache stays loadable (a new engine
resumes it, same output), no temporary or half-written file is left, and a retry once the
disk is writable again saves normally."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import logging
import sqlite3
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from langchain_core.messages import HumanMessage, SystemMessage

from langchain_agent_memory import ChatAgentMemory, corpus
from langchain_agent_memory.engine.engine import Engine, GenerationParams, StreamChunk
from langchain_agent_memory.engine.model.loading import LoadedModel
from langchain_agent_memory.engine.ops.files import TEMP_PREFIX
from langchain_agent_memory.engine.ops.runtime import mx
from langchain_agent_memory.engine.requests import saves as saves_module
from langchain_agent_memory.engine.storage import block_files as files_module
from langchain_agent_memory.engine.storage.blocks import CacheWriteError
from langchain_agent_memory.engine.storage.index import AgentIndex
from langchain_agent_memory.engine.storage.store import DiskBlockStore
from langchain_agent_memory.server.errors import APIError, as_api_errors

GREEDY = GenerationParams(max_tokens=6)
CONTEXT = "You answer questions about this license.\n\n" + corpus.apache_license()
FIRST = CONTEXT[:1200] + "\n\nQ: Its name?\nA:"
SECOND = CONTEXT[:2600] + "\n\nQ: Who wrote it?\nA:"  # extends FIRST's text by new blocks


def _failing_file_writes(monkeypatch: pytest.MonkeyPatch, error: OSError) -> None:
    """Every atomic file write gets half of its data out, then fails with ``error``."""
    real = files_module.atomic_write

    def atomic_write(path: Path, write: Callable[[str], object], suffix: str = ".tmp") -> int:
        def half_then_fail(tmp: str) -> None:
            write(tmp)
            Path(tmp).write_bytes(Path(tmp).read_bytes()[:1000])
            raise error

        return real(path, half_then_fail, suffix)

    monkeypatch.setattr(files_module, "atomic_write", atomic_write)


def _failing_index(monkeypatch: pytest.MonkeyPatch, error: sqlite3.Error) -> None:
    def put(self: AgentIndex, record: object, *sync: object) -> int:
        raise error

    monkeypatch.setattr(AgentIndex, "put", put)


FAULTS = {
    "disk-full-block": (
        lambda mp: _failing_file_writes(mp, OSError(errno.ENOSPC, "No space left on device")),
        "No space left",
    ),
    "permission-block": (
        lambda mp: _failing_file_writes(mp, PermissionError(errno.EACCES, "Permission denied")),
        "Permission denied",
    ),
    "disk-full-index": (
        lambda mp: _failing_index(mp, sqlite3.OperationalError("database or disk is full")),
        "disk is full",
    ),
}


def _clean(store: DiskBlockStore) -> None:
    assert not [p for p in store.dir.rglob(f"{TEMP_PREFIX}*") if p.is_file()], "a temporary file was left"
    assert set(store.blocks.hashes()) == store.records.referenced_blocks(), "a block no record names was left"


@pytest.mark.parametrize("fault", FAULTS, ids=str)
def test_a_failed_save_keeps_the_previous_cache(
    fault: str, smollm: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, figures: dict[str, str]
) -> None:
    engine = Engine("smollm2-135m", cache_dir=tmp_path)
    first = engine.generate("lawyer", FIRST, GREEDY)
    before = engine.admin.store.records.get("lawyer")
    inject, says = FAULTS[fault]
    with monkeypatch.context() as mp:
        inject(mp)
        reply = engine.generate("lawyer", SECOND, GREEDY)  # the reply leaves before its save
        assert reply.saved == "pending" and reply.text
        with pytest.raises(CacheWriteError, match=says) as failure:
            engine.flush()  # the save's failure: raised once
    engine.flush()
    assert "previous cache is intact" in str(failure.value) and "'lawyer'" in str(failure.value)
    assert engine.admin.store.records.get("lawyer") == before
    _clean(engine.admin.store)

    restarted = Engine("smollm2-135m", cache_dir=tmp_path)  # the previous cache still loads
    again = restarted.generate("lawyer", FIRST, GREEDY)
    assert str(again.outcome).startswith("warm") and again.text == first.text
    retry = engine.generate("lawyer", SECOND, GREEDY)  # writable again: saves normally
    engine.flush()
    assert retry.bytes_written > 0 and engine.admin.store.records.get("lawyer").text.startswith(SECOND)  # type: ignore[union-attr]
    _clean(engine.admin.store)
    figures["write errors"] = (
        figures.get("write errors", "") + f"{fault}: raised, old cache loads, retry saves; "
    )


def test_a_failed_save_holds_no_memory_while_its_error_waits_for_flush(
    smollm: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server never calls ``flush``: a failed save's error waits there for good, and its
    traceback's frames held the save's blocks and the agent's layer caches, which had left
    the hot tier (the soak's disk-full fault: ~110 MB of a worker that nothing counted)."""
    engine = Engine("smollm2-135m", cache_dir=tmp_path)
    engine.generate("first", FIRST, GREEDY)
    engine.flush()
    before = _uncounted(engine)
    _failing_file_writes(monkeypatch, OSError(errno.ENOSPC, "No space left on device"))
    reply = engine.generate("long", "Answer.\n\n" + corpus.apache_license()[:6000], GREEDY)
    assert reply.saved == "pending"
    assert engine._save_queue.wait()
    grew = _uncounted(engine) - before
    assert grew < 8e6, f"{grew / 1e6:.0f} MB held beyond the caches after a failed save"  # was ~78
    with pytest.raises(CacheWriteError, match="No space left"):  # the error is kept all the same
        engine.flush()
    engine.close()


def test_a_failed_saves_error_reaches_its_waiter_without_the_saves_frames(
    smollm: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a waiter keeps of a failed save's error holds nothing of the save. A server's
    waiter (``asettled``) wraps the turn's ``save_done`` in an asyncio future, which keeps
    the traceback it is handed (``_exception_tb``); when the error reached it while the save
    thread was still raising it, that traceback's frames held the save's blocks and the
    agent's layer caches for as long as the error was kept (the first failure, for
    ``flush``: a server's whole life; the soak's disk-full fault, now and then: ~100 MB of a
    worker that nothing counted). Here the save thread is held in its log line until the
    waiter has the error, the order a busy machine gives it now and then."""
    engine = Engine("smollm2-135m", cache_dir=tmp_path)
    engine.generate("first", FIRST, GREEDY)
    engine.flush()
    before = _uncounted(engine)
    attached, handed = threading.Event(), threading.Event()
    kept: list[object] = []  # the error's traceback, as asyncio's future keeps it
    frames: list[list[str]] = []

    class HoldTheSaveThread(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "was not saved" in record.getMessage():
                handed.wait(2.0)  # until the waiter has the error (if it can have it yet)

    real = files_module.atomic_write

    def atomic_write(path: Path, write: Callable[[str], object], suffix: str = ".tmp") -> int:
        attached.wait(30)  # the test holds the turn's future before its save fails
        raise OSError(errno.ENOSPC, "No space left on device")

    hold = HoldTheSaveThread(logging.WARNING)
    logging.getLogger(saves_module.__name__).addHandler(hold)
    monkeypatch.setattr(files_module, "atomic_write", atomic_write)
    try:
        *_, last = engine.stream("long", "Answer.\n\n" + corpus.apache_license()[:6000], GREEDY)
        assert last.result is not None and last.result.save_done is not None
        last.result.save_done.add_done_callback(
            lambda done: (
                kept.append(done.exception().__traceback__),  # type: ignore[union-attr]
                frames.append(_frames(done.exception())),
                handed.set(),
            )
        )
        attached.set()
        with pytest.raises(CacheWriteError, match="No space left"):
            last.result.wait_saved(30)
        assert engine._save_queue.wait(30)
    finally:
        logging.getLogger(saves_module.__name__).removeHandler(hold)
        monkeypatch.setattr(files_module, "atomic_write", real)
    grew = _uncounted(engine) - before
    assert grew < 8e6, f"{grew / 1e6:.0f} MB held beyond the caches by the traceback handed on ({frames})"
    assert frames == [[]], f"the waiter was handed the save thread's frames: {frames}"
    with pytest.raises(CacheWriteError, match="No space left"):  # the error is kept all the same
        engine.flush()
    engine.close()


def test_a_stream_that_waits_for_its_failed_save_says_so_and_keeps_nothing_of_the_turn(
    smollm: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A streamed turn on an event loop (the server's) that waits for its save, which fails:
    the last chunk says the save was not kept, in one warning, and the error (kept for
    ``flush``: a server's whole life) carries no frames, of the save thread or of the wait.
    The wait raised it to learn the outcome, which put the turn's frames in its traceback:
    the error kept the turn, its futures, and the asyncio future the wait made, which then
    logged an error with the save's whole traceback when it went ("Future exception was
    never retrieved")."""
    engine = Engine("smollm2-135m", cache_dir=tmp_path)
    _failing_file_writes(monkeypatch, OSError(errno.ENOSPC, "No space left on device"))
    params = GenerationParams(max_tokens=4, wait_for_save=True)

    async def turn() -> list[StreamChunk]:
        return [chunk async for chunk in engine.astream("long", FIRST, params)]

    with caplog.at_level(logging.WARNING):
        *_, last = asyncio.run(turn())
    assert last.result is not None and last.result.saved is False
    assert caplog.text.count("this turn's cache was not saved") == 1, caplog.text
    assert last.result.save_done is not None
    assert _frames(last.result.save_done.exception()) == []
    with pytest.raises(CacheWriteError, match="No space left"):
        engine.flush()
    engine.close()


def _frames(error: BaseException | None) -> list[str]:
    """The functions of the frames ``error`` and its causes carry."""
    names, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        tb = error.__traceback__
        while tb is not None:
            names.append(tb.tb_frame.f_code.co_name)
            tb = tb.tb_next
        error = error.__cause__ or error.__context__
    return names


def _uncounted(engine: Engine) -> int:
    """mlx's memory beyond what the caches say they hold (``Engine.stats``)."""
    gc.collect()
    mx.synchronize()
    stats = engine.stats()
    counted = stats["hot_tier"]["bytes"] + stats["pool"]["hot_bytes"]
    return mx.get_active_memory() - counted - stats["serving_bytes"] - stats["queued_save_bytes"]


def test_the_error_reaches_a_langchain_caller(
    smollm: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = ChatAgentMemory(cache_dir=str(tmp_path), agent_id="lawyer", max_tokens=4)
    messages = [SystemMessage(CONTEXT[:1500]), HumanMessage("Its name?")]
    llm.invoke(messages)
    _failing_file_writes(monkeypatch, OSError(errno.ENOSPC, "No space left on device"))
    reply = llm.invoke([SystemMessage(CONTEXT[:3000]), HumanMessage("Who wrote it?")])
    assert reply.response_metadata["cache_saved"] == "pending"  # written after the reply left
    with pytest.raises(CacheWriteError, match="No space left"):
        llm.flush()


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real filesystem of 48 MB (a tmpfs; the test is skipped where mounting is refused)."""
    where = tmp_path / "disk"
    where.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(where)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"no tmpfs can be mounted here: {done.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _fill(path: Path) -> None:
    with contextlib.suppress(OSError), open(path, "wb") as f:
        while True:
            f.write(b"\0" * (1 << 16))


def test_a_full_disk_refuses_a_fork_a_delete_and_a_save_with_what_to_do(
    smollm: LoadedModel, small_disk: Path
) -> None:
    """Filled to its last byte, the disk refuses the index's writes too (SQLite: 'database or
    disk is full'): a fork, a delete and a save each raise ``CacheWriteError`` saying what to
    do (the server's 507, not a 500 'generation failed'), nothing is changed, and each
    succeeds once space is freed."""
    engine = Engine("smollm2-135m", cache_dir=small_disk / "cache")
    engine.generate("lawyer", FIRST, GREEDY)
    engine.flush()
    before = engine.admin.store.records.get("lawyer")
    ballast = small_disk / "ballast"
    _fill(ballast)
    for refused in (lambda: engine.admin.fork("lawyer", "clerk"), lambda: engine.admin.delete("lawyer")):
        with pytest.raises(APIError) as answered, as_api_errors():
            refused()
        assert answered.value.status == 507 and "free disk space" in answered.value.message
    assert engine.generate("lawyer", SECOND, GREEDY).text  # served; its save is refused
    with pytest.raises(CacheWriteError, match="free disk space"):
        engine.flush()
    assert (
        engine.admin.store.records.get("lawyer") == before and engine.admin.store.records.get("clerk") is None
    )
    ballast.unlink()
    assert engine.admin.fork("lawyer", "clerk") == before
    assert engine.admin.delete("lawyer") and engine.admin.store.records.get("lawyer") is None
    assert str(engine.generate("clerk", FIRST, GREEDY).outcome).startswith(("hot", "warm"))
    engine.close()
