"""Work in order per key, different keys at once (``ops.lanes``), and the directory lock
that is ``flock`` alone (``ops.files``): races forced with events, not left to timing."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from langchain_agent_memory.engine.ops.files import DirectoryLock
from langchain_agent_memory.engine.ops.lanes import Lanes


def test_one_keys_jobs_run_in_order_while_another_key_goes_ahead() -> None:
    lanes = Lanes("test-lanes", 4)
    try:
        held, release = threading.Event(), threading.Event()
        ran: list[str] = []

        def stuck() -> None:  # an upload that sits on a hung database
            held.set()
            assert release.wait(10)
            ran.append("a1")

        first = lanes.submit("a", stuck)
        assert held.wait(10)
        second = lanes.submit("a", ran.append, "a2")  # behind a1: its own agent's work
        assert lanes.call("b", lambda: "b went ahead") == "b went ahead"
        assert not second.done() and ran == []
        release.set()
        second.result(10)
        first.result(10)
        assert ran == ["a1", "a2"]
    finally:
        release.set()
        lanes.close()


def test_a_failed_job_does_not_stop_its_key() -> None:
    lanes = Lanes("test-lanes", 2)
    try:

        def fails() -> None:
            raise ValueError("the store said no")

        failed = lanes.submit("a", fails)
        after = lanes.submit("a", lambda: "next")
        assert isinstance(failed.exception(10), ValueError)
        assert after.result(10) == "next"
    finally:
        lanes.close()


def test_close_runs_the_jobs_queued_before_it_and_later_calls_run_on_their_callers() -> None:
    lanes = Lanes("test-lanes", 2)
    release = threading.Event()
    done: list[int] = []
    lanes.submit("a", release.wait, 10)
    queued = [lanes.submit("a", done.append, i) for i in range(3)]
    closing = threading.Thread(target=lanes.close)
    closing.start()
    release.set()
    closing.join(10)
    assert not closing.is_alive() and [f.result(0) for f in queued] == [None] * 3 and done == [0, 1, 2]
    assert lanes.call("a", lambda: "on the caller") == "on the caller"  # the dispatcher is gone


def test_the_directory_lock_excludes_threads_and_is_reentrant(tmp_path: Path) -> None:
    lock = DirectoryLock(tmp_path / "lock")
    inside: list[int] = []
    overlaps: list[list[int]] = []
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with lock, lock:  # re-entrant on its thread
            holding.set()
            assert release.wait(10)

    def enter(i: int) -> None:
        with lock:
            inside.append(i)
            if len(inside) > 1:
                overlaps.append(list(inside))
            time.sleep(0.001)
            inside.remove(i)

    holder = threading.Thread(target=hold)
    holder.start()
    assert holding.wait(10)
    waiter = threading.Thread(target=enter, args=(0,))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive(), "another thread entered while the lock was held"
    release.set()
    holder.join(10)
    waiter.join(10)
    threads = [threading.Thread(target=lambda i=i: [enter(i) for _ in range(20)]) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert overlaps == []
