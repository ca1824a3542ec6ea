"""The process runtime (engine/ops/process.py): every thread the engine starts is one it
lends, and ``shutdown()`` ends all the process holds (threads, loaded models, shared
engines) while a new engine afterwards works; the interpreter's exit after it is clean."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

from langchain_agent_memory.engine.engine import Engine, GenerationParams
from langchain_agent_memory.engine.model.loading import LoadedModel
from langchain_agent_memory.engine.ops.process import RUNTIME

#: A process as an operator's script runs it: a shared engine and one of its own serve,
#: ``shutdown()``, then what is left; a new engine on the same directory; exit, no close().
SCRIPT = textwrap.dedent(
    """
    import sys
    import threading

    from langchain_agent_memory.engine import Engine, GenerationParams, shared_engine, shutdown
    from langchain_agent_memory.engine.model.loading import loaded_models
    from langchain_agent_memory.engine.registry import engine_registry

    cache_dir = sys.argv[1]
    params = GenerationParams(max_tokens=3)
    shared = shared_engine("smollm2-135m", cache_dir=cache_dir, kv_bits=None)
    own = Engine("smollm2-135m", cache_dir=cache_dir + "/own", kv_bits=None)
    shared.generate("a", "Agent a says hello to", params)
    own.generate("b", "Agent b says hello to", params)
    shutdown()
    print("threads", sorted(t.name for t in threading.enumerate() if t is not threading.main_thread()))
    print("models", len(loaded_models()), "engines", len(engine_registry().engines))
    try:
        own.generate("b", "Agent b says hello to", params)
    except RuntimeError as exc:
        print("closed", exc)
    again = Engine("smollm2-135m", cache_dir=cache_dir, kv_bits=None)
    reply = again.generate("a", "Agent a says hello to", params)
    print("reused", reply.reused_tokens, flush=True)
    """
)


def test_shutdown_ends_every_engine_thread_and_forgets_models_and_engines(
    smollm: LoadedModel, tmp_path: Path
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "c")], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]  # no MLX abort at exit (134) either
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert lines["threads"] == "[]", lines  # no engine thread (a worker, saves, pools) is left
    assert lines["models"] == "0 engines 0", lines
    assert "closed" in lines["closed"], lines  # the engine of its own was closed too
    assert int(lines["reused"]) > 0, lines  # a new engine works, from what the first one saved


def test_every_thread_an_engine_on_a_shared_store_starts_is_lent_by_the_runtime(
    smollm: LoadedModel, shared_store: tuple[str, str], tmp_path: Path
) -> None:
    """A request's lease, fetch, save, upload and commit notice run on threads of the
    process runtime (named after what they do), none started on the side."""
    store, blocks = shared_store
    before = set(threading.enumerate())
    with Engine("smollm2-135m", cache_dir=tmp_path / "c", kv_bits=None, store=store, blocks=blocks) as engine:
        engine.generate("agent", "Agent a says hello to", GenerationParams(max_tokens=3))
        engine.flush()
        alive = threading.enumerate()
        lent = set(RUNTIME.threads())
        names = sorted(t.name for t in alive)  # as named while the engine is open
    assert {"agent-memory-mlx", "agent-memory-saves", "agent-memory-remote"} <= set(names), names
    assert not [t.name for t in alive if t not in before and t not in lent], names


#: A script that ends while its engine is busy: a thread of its own streams a long reply
#: and the main thread returns mid-decode (no close(), no shutdown()).
BUSY_AT_EXIT = textwrap.dedent(
    """
    import sys
    import threading

    from langchain_agent_memory.engine import Engine, GenerationParams

    engine = Engine("smollm2-135m", cache_dir=sys.argv[1], kv_bits=None)
    decoding = threading.Event()

    def stream():
        for _ in engine.stream("a", "Agent a tells a long story:", GenerationParams(max_tokens=100000)):
            decoding.set()

    threading.Thread(target=stream, daemon=True).start()
    decoding.wait()
    print("decoding", flush=True)
    """
)


def test_a_process_that_exits_while_its_engine_decodes_ends_cleanly(
    smollm: LoadedModel, tmp_path: Path
) -> None:
    """The interpreter finalizes with no runtime thread inside MLX: one that is there then
    aborts the process (exit code 134, "terminate called without an active exception"),
    which a user's script, a server's shutdown or a test run reports as a crash."""
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "-c", BUSY_AT_EXIT, str(tmp_path / "c")],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.strip() == "decoding"
