"""Where a warm restore's time goes, part by part (benchmarks/gpu.py's "warm" cell: a new
engine reads an agent's blocks from the page cache and answers a new turn).

    python3 benchmarks/restore_profile.py --ctx 32768 --model llama-3.1-8b   # on the GPU
    python3 benchmarks/restore_profile.py --ctx 2048 --model llama           # a quick check here

RANDOM WEIGHTS (``gpu.random_model_dir``): timings only. One engine writes the agent (and a
4K one that warms every kernel up), then a second engine on the same directory (the model
is loaded once per process) restores it ``--reps`` times, the pool's memory tier emptied
before each, with the reader's steps timed by wrappers: the headers (read and checked one
after another), the group reads (wall), and summed over the reader threads the file reads,
the checksums and the host -> GPU copies; then the layer build and what the turn does after
the load. Then the floors on the same files: reading them on the reader's threads (as
``cat`` to /dev/null would: the page cache's speed), with XXH3 beside, and the copies alone.
Prints one JSON object per line (and appends them to ``$OUT/restore_profile.jsonl``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu.py, peers.py: run as a script
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jsonl_rows import emitter

import langchain_agent_memory  # noqa: F401  (before mlx)

SUMS: dict[str, float] = defaultdict(float)
COUNTS: dict[str, int] = defaultdict(int)
_lock = threading.Lock()


emit = emitter("restore_profile.jsonl")


def timed(owner: Any, name: str, key: str) -> None:
    """Wrap ``owner.name`` so that its calls' seconds add up in ``SUMS[key]``."""
    inner = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            dt = time.perf_counter() - t0
            with _lock:
                SUMS[key] += dt
                COUNTS[key] += 1

    setattr(owner, name, wrapper)


def instrument(layer_class: type) -> None:
    from langchain_agent_memory.engine.caches import agents, restore
    from langchain_agent_memory.engine.ops import cuda_memory
    from langchain_agent_memory.engine.storage import block_files, reader

    timed(block_files.BlockFiles, "_headers", "headers_s")
    timed(block_files, "read_groups", "read_groups_s")
    timed(reader, "_fill", "threads_fill_s")  # read + checksum, summed over threads
    timed(block_files, "_verify", "threads_checksum_s")
    timed(cuda_memory.Upload, "write", "threads_copy_s")
    timed(cuda_memory.Upload, "make", "upload_alloc_s")
    timed(restore, "_sources", "sources_s")  # headers + group reads
    timed(layer_class, "from_blocks", "layers_build_s")
    timed(agents, "layers_from_blocks", "layers_from_blocks_s")
    timed(agents.AgentCaches, "materialize", "materialize_s")


def floors(paths: list[Path], threads: int) -> None:
    """The same files read on ``threads`` threads: into fresh pageable memory (``cat``'s
    work), into reused pinned buffers with XXH3 beside, and the host -> GPU copies alone."""
    import numpy as np
    import xxhash

    from langchain_agent_memory.engine.ops import cuda_memory
    from langchain_agent_memory.engine.ops.runtime import mx

    sizes = [p.stat().st_size for p in paths]
    total = sum(sizes)

    def run(fn: Callable[[int], None]) -> float:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(fn, range(len(paths))))
        return time.perf_counter() - t0

    def plain(i: int) -> None:
        buf = np.empty(sizes[i], np.uint8)
        with open(paths[i], "rb") as f:
            f.readinto(memoryview(buf))

    def pinned(i: int, hash_too: bool = False) -> None:
        with cuda_memory.staging(sizes[i]) as buf:
            with open(paths[i], "rb") as f:
                f.readinto(memoryview(buf))
            if hash_too:
                xxhash.xxh3_128(buf).hexdigest()

    for rep in range(2):
        row: dict[str, Any] = {"probe": "floors", "rep": rep, "files": len(paths), "gb": total / 1e9}
        row["read_pageable_s"] = run(plain)
        row["read_pinned_s"] = run(pinned)
        row["read_pinned_xxh3_s"] = run(lambda i: pinned(i, True))
        up = cuda_memory.Upload.make(len(paths), max(sizes))
        if up is not None:
            with cuda_memory.staging(max(sizes)) as buf:
                t0 = time.perf_counter()
                for i in range(len(paths)):
                    up.write(i, buf)
                row["copy_one_thread_s"] = time.perf_counter() - t0

            def copy(i: int, up: Any = up) -> None:
                with cuda_memory.staging(max(sizes)) as b:
                    up.write(i, b)

            row["copy_threads_s"] = run(copy)
            row["copy_async_threads_s"] = _async_copies(up, max(sizes), len(paths), threads)
            t0 = time.perf_counter()
            again = cuda_memory.Upload.make(len(paths), max(sizes))
            row["upload_alloc_s"] = time.perf_counter() - t0
            del up, again
            mx.clear_cache()
        row["read_gbps"] = total / 1e9 / row["read_pinned_xxh3_s"]
        row["headers_serial_s"], row["headers_threads_s"] = _headers(paths, threads)
        emit(**row)


def _headers(paths: list[Path], threads: int) -> tuple[float, float]:
    """The files' headers read and parsed one after another (as ``BlockFiles._headers``
    does) and on ``threads`` threads."""
    from langchain_agent_memory.engine.storage import reader

    t0 = time.perf_counter()
    layouts: reader.Layouts = {}
    for p in paths:
        reader.read_header(p, layouts)
    t1 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(lambda p: reader.read_header(p, layouts), paths))
    return t1 - t0, time.perf_counter() - t1


def _async_copies(up: Any, size: int, n: int, threads: int) -> float | None:
    """``n`` copies of ``size`` pinned bytes into ``up``'s rows, each thread on a stream of
    its own (``cudaMemcpyAsync``, then a synchronize), against ``cudaMemcpy``'s legacy
    stream, which orders every copy after all the others."""
    import ctypes

    from langchain_agent_memory.engine.ops import cuda_memory

    rt = cuda_memory.runtime()
    if rt is None:
        return None
    lib = rt.lib
    lib.cudaMemcpyAsync.argtypes = (
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_void_p,
    )
    lib.cudaStreamSynchronize.argtypes = (ctypes.c_void_p,)
    local = threading.local()

    def copy(i: int) -> None:
        if not hasattr(local, "stream"):
            local.stream = ctypes.c_void_p()
            lib.cudaStreamCreateWithFlags(ctypes.byref(local.stream), 1)  # non-blocking
        with cuda_memory.staging(size) as b:
            err = lib.cudaMemcpyAsync(up._base + i * up.width, b.ctypes.data, size, 4, local.stream)
            err = err or lib.cudaStreamSynchronize(local.stream)
            assert err == 0, err

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(copy, range(n)))
    return time.perf_counter() - t0


_BOOT = ("run", "_bootstrap", "_bootstrap_inner", "_named", "_serve", "_run_loop", "_loop")


def _sampled(
    run: Callable[[], Any], every_s: float = 0.0005, main_too: bool = False
) -> tuple[Any, dict[str, Any]]:
    """``run()`` while a thread samples every other thread's stack each ``every_s`` (the
    engine's work is on its model and reader threads, which cProfile does not see): per
    function, the samples it was running in (``self``) and under (``total``); ``main_too``: the
    calling thread too (a restore read on it)."""
    import sys
    from collections import Counter

    own: Counter[str] = Counter()
    total: Counter[str] = Counter()
    done = threading.Event()
    me = threading.get_ident()
    samples = 0

    def sample() -> None:
        nonlocal samples
        names = {t.ident: t.name for t in threading.enumerate()}
        while not done.wait(every_s):
            for ident, frame in sys._current_frames().items():
                if ident == threading.get_ident() or (ident == me and not main_too):
                    continue
                thread = names.get(ident, "?").split("_")[0]
                seen, f, leaf = set(), frame, True
                while f is not None:
                    where = f"{thread}:{Path(f.f_code.co_filename).name}:{f.f_code.co_name}"
                    if leaf:
                        own[where] += 1
                        leaf = False
                    if where not in seen:
                        seen.add(where)
                        total[where] += 1
                    f = f.f_back
            samples += 1
            names = {t.ident: t.name for t in threading.enumerate()}

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        out = run()
    finally:
        done.set()
        sampler.join()
    idle = ("wait", "acquire", "_worker", "get", "select", "sleep", "_wait_for_tstate_lock")
    busy = {k: v for k, v in own.items() if not k.endswith(idle)}
    return out, {
        "samples": samples,
        "every_s": every_s,
        "self": Counter(busy).most_common(30),
        "total": [kv for kv in total.most_common() if not kv[0].endswith(idle + _BOOT)][:60],
    }


def _profiled(eng: Any, prompt: str, one: Any) -> None:
    """A warm turn, then a hot one, sampled (``_sampled``): where the engine's threads were."""
    from peers import extension

    from langchain_agent_memory.engine.ops.runtime import mx

    for kind, i in (("warm", 20), ("hot", 21), ("warm", 22), ("hot", 23)):
        if kind == "warm":
            eng.flush()
            eng.admin.drop_hot()
            eng.admin.clear_memory()
            mx.clear_cache()
        r, where = _sampled(lambda i=i: eng.generate("bench", prompt + extension(i), one))
        emit(probe=f"sampled-{kind}", ttft_s=r.timings.ttft_s, load_s=r.timings.load_s,
             prefill_s=r.timings.prefill_s, outcome=str(r.outcome), **where)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--kv-bits", type=int, default=4, choices=(4, 8, 16), help="16: the 16-bit format")
    ap.add_argument("--root", default=None)
    ap.add_argument("--ab", action="store_true", help="odd reps: digests tensor by tensor (the old way)")
    ap.add_argument("--sample", action="store_true", help="then warm and hot turns, their threads sampled")
    ap.add_argument("--floors", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args()

    from gpu import prompt_text, random_model_dir
    from peers import extension

    from langchain_agent_memory.engine.engine import Engine, GenerationParams
    from langchain_agent_memory.engine.ops.runtime import mx
    from langchain_agent_memory.engine.storage import reader

    root = Path(args.root or tempfile.mkdtemp(prefix="restore-profile-"))
    t0 = time.perf_counter()
    model_dir = random_model_dir(args.model, root / "model")
    emit(probe="build", s=time.perf_counter() - t0, device=str(mx.default_device()))

    def engine() -> Any:
        bits = None if args.kv_bits == 16 else args.kv_bits
        return Engine(
            model_dir, cache_dir=root / f"state-{args.kv_bits}", kv_bits=bits, context_length=2 * args.ctx
        )

    one = GenerationParams(max_tokens=1)
    writer = engine()
    tok = writer.tokenizer
    small, prompt = prompt_text(tok, min(4096, args.ctx // 2)), prompt_text(tok, args.ctx)
    t0 = time.perf_counter()
    writer.generate("small", small, one)
    writer.generate("bench", prompt, one)
    writer.flush()
    emit(probe="write", s=time.perf_counter() - t0)
    writer.close()

    eng = engine()
    instrument(type(eng.agents.new_layers()[0]))
    eng.generate("small", small + extension(1), one)  # every kernel of a warm turn compiled
    record = eng.admin.store.records.get("bench")
    assert record is not None
    gather_threads = reader.GATHER_THREADS
    for rep in range(args.reps):
        eng.flush()
        eng.admin.drop_hot()
        eng.admin.clear_memory()
        mx.clear_cache()
        SUMS.clear()
        COUNTS.clear()
        # A/B in one process: odd reps hash tensor by tensor, even ones the gathered input
        gathered = not (args.ab and rep % 2)
        reader.GATHER_THREADS = gather_threads if gathered else 1 << 10
        r = eng.generate("bench", prompt + extension(2 + rep), one)
        t = r.timings
        emit(probe="warm", rep=rep, outcome=str(r.outcome), ttft_s=t.ttft_s, load_s=t.load_s,
             prefill_s=t.prefill_s, threads=reader.READ_THREADS, gathered=gathered, kv_bits=args.kv_bits,
             **{k: round(v, 5) for k, v in SUMS.items()}, calls=dict(COUNTS))  # fmt: skip
    reader.GATHER_THREADS = gather_threads
    if args.sample:
        _profiled(eng, prompt, one)
    if not args.floors:
        eng.close()
        return
    paths = [eng.admin.store.path(h) for h in record.blocks] if hasattr(eng.admin.store, "path") else []
    if not paths:
        paths = sorted((root / f"state-{args.kv_bits}").rglob("*.safetensors"))
        paths = [p for p in paths if p.stem in set(record.blocks)]
    floors(paths, reader.READ_THREADS)
    eng.close()


if __name__ == "__main__":
    main()
