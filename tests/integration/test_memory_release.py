"""A closed engine gives its memory back to the system: what a long-lived process that
opens and closes engines (a server switching models, a test session) watches in its RSS."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest

from langchain_agent_memory.engine.engine import Engine, GenerationParams
from langchain_agent_memory.engine.model.loading import LoadedModel, unload_models
from langchain_agent_memory.testing.random_model import SMALL_CONFIGS, write_random_model


def _rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads /proc (Linux)")
def test_a_closed_engine_and_its_unloaded_model_leave_little_behind(
    smollm: LoadedModel, tmp_path: Path, figures: dict[str, str]
) -> None:
    # Random weights, ~0.6 GB at float32: big enough to see, quick to build.
    wide = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 6}
    model = write_random_model({**SMALL_CONFIGS["llama"], **wide}, tmp_path / "m", smollm.path, seed=3)
    gc.collect()
    before = _rss()
    with Engine(model, cache_dir=tmp_path / "c", kv_bits=None) as engine:
        for i in range(3):
            engine.generate(f"a{i}", "word " * 600 + f"agent {i}:", GenerationParams(max_tokens=8))
        during = _rss()
    del engine  # what a caller holds, it keeps
    unload_models(tmp_path / "m")
    after = _rss()
    grown, kept = during - before, after - before
    assert grown > 500e6, grown  # the model and the agents' caches were in memory
    assert kept < 0.1 * grown, (before, during, after)  # 24 % stayed when glibc kept its free pages
    figures["memory after close"] = (
        f"an engine of a 0.6 GB model (random weights) grew RSS by {grown / 1e9:.2f} GB; "
        f"{max(kept, 0) / 1e9:.2f} GB of it stayed after close() and unload_models"
    )


def _native_threads() -> int:
    return len(list(Path("/proc/self/task").iterdir()))


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc (Linux)")
def test_engines_opened_and_closed_by_the_dozen_leave_no_threads_behind(
    smollm: LoadedModel, tmp_path: Path, figures: dict[str, str]
) -> None:
    """Each thread that runs MLX work gets native threads of mlx's (one per stream) and of
    the BLAS that never end; engines borrow their worker threads from the process, so a
    server swapping engines or a suite of a hundred models does not pile them up (it did:
    ~48 native threads a model in the model matrix, which ran 3x slower by its end)."""
    params = GenerationParams(max_tokens=2)

    def cycle(i: int) -> None:
        engine = Engine("smollm2-135m", cache_dir=tmp_path / str(i), kv_bits=None)
        engine.generate("a", f"Agent {i} says hello to", params)
        if i % 2:
            engine.close()
        else:  # dropped without close(), as scripts and notebooks do: freed all the same
            engine.flush()
            alive = weakref.ref(engine)
            del engine
            gc.collect()
            assert alive() is None

    for i in range(4):  # the first engines' threads (a lent worker, its streams, BLAS; the
        cycle(i)  # closing thread's own mlx streams) stay for the next: a plateau, not a leak
    settled = _native_threads()
    for i in range(4, 16):
        cycle(i)
    gc.collect()
    after = _native_threads()
    # A background save's thread may linger, and a second worker (its mlx streams, its BLAS
    # team: 4 native threads) is lent when a dropped engine is still being finalized as the
    # next one starts: once, whenever that happens. The leak this guards against was ~48 a model.
    assert after <= settled + 6, (settled, after)
    figures["threads after 12 engines"] = (
        f"{settled} native threads after one engine, {after} after 12 more (6 closed, 6 dropped)"
    )


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc (Linux)")
def test_shared_store_engines_opened_and_closed_leave_no_thread_or_connection(
    smollm: LoadedModel, shared_store: tuple[str, str], postgres_url: str, tmp_path: Path,
    figures: dict[str, str],
) -> None:  # fmt: skip
    """A server that swaps engines (models, settings) on a shared store all day: every
    thread an engine starts (its admissions, the store's I/O and uploader, the lease
    heartbeat, the database's watchdog and probe) ends at ``close()``, and every database
    connection it opened is closed (PostgreSQL's own view, ``pg_stat_activity``)."""
    import threading
    import time

    import psycopg

    store, blocks = shared_store
    params = GenerationParams(max_tokens=2)

    def connections() -> int:
        with psycopg.connect(store, autocommit=True) as conn:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> pg_backend_pid()"
            ).fetchone()
        return int(row[0]) if row else 0

    def cycle(i: int) -> None:
        with Engine("smollm2-135m", cache_dir=tmp_path / "c", kv_bits=None, store=store, blocks=blocks) as e:
            if i % 15 == 0:  # now and then a request: a lease, a fetch, a save and its upload
                e.generate(f"agent {i % 2}", f"Agent {i} says hello to", params)
                e.flush()

    cycle(0)  # the first engine's threads (a lent worker, its streams, BLAS) stay for the next
    gc.collect()
    names, native = {t.name for t in threading.enumerate()}, _native_threads()
    started = time.perf_counter()
    cycles = 60  # a thread or connection left per cycle, or per request, shows as dozens
    for i in range(1, cycles + 1):
        cycle(i)
    took = time.perf_counter() - started
    gc.collect()
    left = sorted({t.name for t in threading.enumerate()} - names)
    assert not left, left
    assert _native_threads() <= native + 2, (native, _native_threads())
    assert connections() == 0
    figures["shared-store engines opened and closed"] = (
        f"{cycles} cycles in {took:.0f} s: no thread or database connection left "
        f"({native} native threads before and {_native_threads()} after)"
    )
