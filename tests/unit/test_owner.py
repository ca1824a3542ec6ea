"""The owner check: an engine's cache state is mutated on its loop thread only; a helper
thread that mutates it directly is caught where it does (``ops.owner``, on in the suite)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from langchain_agent_memory.engine.caches.agent_state import HotPolicy
from langchain_agent_memory.engine.caches.hot_agents import HotAgents
from langchain_agent_memory.engine.ops.owner import CHECK_OWNER, OwnerError
from langchain_agent_memory.engine.ops.runtime import mx
from langchain_agent_memory.engine.requests.worker import Worker
from langchain_agent_memory.engine.storage.blocks import Block, block_hash
from langchain_agent_memory.engine.storage.pool import BlockPool
from langchain_agent_memory.engine.storage.store import DiskBlockStore

pytestmark = pytest.mark.skipif(not CHECK_OWNER, reason="the owner check is off (AGENT_MEMORY_OWNER_CHECK)")


@pytest.fixture
def loop() -> Iterator[Worker]:
    worker = Worker("test-owner-loop")
    worker.submit(lambda: None).result()  # bound: the loop runs
    yield worker
    worker.stop()


def _on_helper_thread(fn: Callable[[], object]) -> BaseException | None:
    """What ``fn`` raised on a thread of its own (None: nothing)."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=run, name="helper")
    thread.start()
    thread.join()
    return raised[0] if raised else None


def _block(fp: str) -> Block:
    return Block(block_hash(None, [1], fp), None, [1], {"L0.k": mx.zeros((1, 1, 4, 16), dtype=mx.float16)})


def test_a_helper_thread_mutating_the_hot_tier_raises(loop: Worker) -> None:
    hot = HotAgents(HotPolicy(max_agents=4, work_budget_bytes=0), lambda: (), owner=loop.owner)
    loop.submit(hot.drop, "a").result()  # the loop may
    exc = _on_helper_thread(lambda: hot.drop("a"))
    assert isinstance(exc, OwnerError)
    assert "HotAgents.drop" in str(exc) and "helper" in str(exc)


def test_a_helper_thread_filling_the_pool_raises(loop: Worker, tmp_path: Path) -> None:
    store = DiskBlockStore(tmp_path, "fp")
    pool = BlockPool(store, 1 << 20, owner=loop.owner)
    block = _block("fp")
    loop.submit(pool.admit, block).result()  # the loop keeps it hot
    assert loop.submit(pool.is_hot, block.hash).result()
    exc = _on_helper_thread(lambda: pool.admit(block))
    assert isinstance(exc, OwnerError) and "BlockPool" in str(exc)
    exc = _on_helper_thread(lambda: pool.forget(block.hash))
    assert isinstance(exc, OwnerError)
    assert loop.submit(pool.is_hot, block.hash).result()  # nothing changed off the loop
