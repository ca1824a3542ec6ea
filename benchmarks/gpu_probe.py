"""Where the time goes on the GPU: the diagnostics behind benchmarks/README.md's GPU notes.

Device only (mlx's CUDA build), run after ``benchmarks/gpu_install.sh``:

    python3 benchmarks/gpu_probe.py upload             # host -> GPU strategies, 1.5 GB
    python3 benchmarks/gpu_probe.py engine --ctx 32768 # warm / hot / batched decode, step by step

RANDOM WEIGHTS (Llama-3.1-8B shape, bf16) for ``engine``: timings only. Prints one JSON
object per measurement (and writes them to ``$OUT/probe.jsonl`` when ``OUT`` is set).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from jsonl_rows import emitter  # noqa: E402  (beside this script)

emit = emitter("probe.jsonl")


# ------------------------------------------------------------------------------ upload


class _MemLocation(ctypes.Structure):
    """``cudaMemLocation`` (CUDA >= 12.2)."""

    _fields_ = (("type", ctypes.c_int), ("id", ctypes.c_int))


def prefetch(arrays: list[Any]) -> bool:
    """``cudaMemPrefetchAsync`` of evaluated managed ``arrays`` to GPU 0 (the alternative
    ``engine/ops/cuda_memory.py`` measured against); whether it was done."""
    from langchain_agent_memory.engine.ops import cuda_memory

    rt = cuda_memory.runtime()
    if rt is None:
        return False
    fn = getattr(rt.lib, "cudaMemPrefetchAsync" if rt.version >= 13000 else "cudaMemPrefetchAsync_v2", None)
    if fn is None:
        return False
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, _MemLocation, ctypes.c_uint, ctypes.c_void_p)
    for a in arrays:
        host = np.asarray(memoryview(a))
        if fn(host.ctypes.data, host.nbytes, _MemLocation(1, 0), 0, None) != 0:  # 1: a device
            return False
    return rt.lib.cudaDeviceSynchronize() == 0


def upload(n_files: int, size: int) -> None:
    """1.5 GB of block-like files from the page cache to the GPU, several ways."""
    from langchain_agent_memory.engine.ops import cuda_memory
    from langchain_agent_memory.engine.ops.runtime import mx

    d = Path(tempfile.mkdtemp(prefix="probe-upload-"))
    data = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8).tobytes()
    paths = []
    for i in range(n_files):
        p = d / f"{i}.bin"
        p.write_bytes(data)
        paths.append(p)
    pool = ThreadPoolExecutor(16)

    def read_rows(dest: np.ndarray, sha: bool, rows: range | None = None) -> None:
        def one(i: int) -> None:
            with open(paths[i], "rb") as f:
                f.readinto(memoryview(dest[i]))
            if sha:
                hashlib.sha256(dest[i]).digest()

        list(pool.map(one, rows if rows is not None else range(n_files)))

    def gpu_touch(a: mx.array) -> mx.array:
        return (a.view(mx.uint32) ^ 1).sum(axis=-1)  # reads every byte, small output

    def timed(name: str, **steps: Any) -> None:
        emit(
            probe="upload",
            variant=name,
            gb=n_files * size / 1e9,
            **{k: round(v, 4) for k, v in steps.items()},
        )

    host = np.empty((n_files, size), np.uint8)
    read_rows(host, False)  # the page cache, warmed
    for _ in range(2):
        mx.clear_cache()
        t0 = time.perf_counter()
        read_rows(host, False)
        t1 = time.perf_counter()
        read_rows(host, True)
        t2 = time.perf_counter()
        timed("read (16 threads), then read+sha256", read_s=t1 - t0, read_sha_s=t2 - t1)
        # A: as today: numpy -> mx.array -> first kernel faults the pages over
        t0 = time.perf_counter()
        a = mx.array(host)
        t1 = time.perf_counter()
        mx.eval(gpu_touch(a))
        t2 = time.perf_counter()
        mx.eval(gpu_touch(a))
        t3 = time.perf_counter()
        timed("mx.array(host) + first kernel", array_s=t1 - t0, first_kernel_s=t2 - t1, again_s=t3 - t2)
        del a
        mx.clear_cache()
        # B: prefetch before the first kernel
        t0 = time.perf_counter()
        a = mx.array(host)
        t1 = time.perf_counter()
        ok = prefetch([a])
        t2 = time.perf_counter()
        mx.eval(gpu_touch(a))
        t3 = time.perf_counter()
        timed(
            f"mx.array(host) + prefetch ({ok}) + kernel",
            array_s=t1 - t0,
            prefetch_s=t2 - t1,
            kernel_s=t3 - t2,
        )
        del a
        mx.clear_cache()
        # C: read straight into a managed array, prefetch, kernel
        t0 = time.perf_counter()
        a = mx.zeros(host.shape, mx.uint8, stream=mx.cpu)
        mx.eval(a)
        view = np.asarray(memoryview(a))
        t1 = time.perf_counter()
        read_rows(view, True)
        t2 = time.perf_counter()
        ok = prefetch([a])
        t3 = time.perf_counter()
        mx.eval(gpu_touch(a))
        t4 = time.perf_counter()
        timed(f"zeros(cpu) + read into it + prefetch ({ok}) + kernel", alloc_s=t1 - t0, read_sha_s=t2 - t1,
              prefetch_s=t3 - t2, kernel_s=t4 - t3)  # fmt: skip
        del a, view
        mx.clear_cache()
        # E: what reader.py does on CUDA: a GPU-made destination, each row cudaMemcpy'd by
        # the thread that read it
        t0 = time.perf_counter()
        up = cuda_memory.Upload.make(n_files, size)
        t1 = time.perf_counter()
        if up is not None:

            def one(i: int, up: Any = up) -> None:
                with cuda_memory.staging(size) as buf:
                    with open(paths[i], "rb") as f:
                        f.readinto(memoryview(buf))
                    hashlib.sha256(buf).digest()
                    up.write(i, buf)

            list(pool.map(one, range(n_files)))
            t2 = time.perf_counter()
            a = up.array
            mx.eval(gpu_touch(a))
            t3 = time.perf_counter()
            timed("Upload: GPU buffer + read+sha (pinned) + cudaMemcpy per row", alloc_s=t1 - t0,
                  read_copy_s=t2 - t1, kernel_s=t3 - t2)  # fmt: skip
            del a, up
            mx.clear_cache()
        # D: pipelined: 8 slices, each read -> array -> prefetch while the next is read
        t0 = time.perf_counter()
        parts, futs = [], []
        step = n_files // 8
        pre = ThreadPoolExecutor(1)
        for s in range(0, n_files, step):
            read_rows(host, True, range(s, s + step))
            part = mx.array(host[s : s + step])
            parts.append(part)
            futs.append(pre.submit(prefetch, [part]))
        for f in futs:
            f.result()
        t1 = time.perf_counter()
        mx.eval([gpu_touch(p) for p in parts])
        t2 = time.perf_counter()
        timed("pipelined 8 slices: read+sha -> array -> prefetch", pipeline_s=t1 - t0, kernel_s=t2 - t1)
        del parts
        mx.clear_cache()


# ------------------------------------------------------------------------------ engine


def _engine(model_dir: Path, root: Path, kv_bits: int | None = 4) -> Any:
    from langchain_agent_memory.engine.engine import Engine

    return Engine(model_dir, cache_dir=root, kv_bits=kv_bits, context_length=140_000)


def engine_main(ctx: int, model: str, turns_only: bool) -> None:
    from gpu import prompt_text
    from peers import extension

    from langchain_agent_memory.engine import load_model
    from langchain_agent_memory.engine.engine import GenerationParams
    from langchain_agent_memory.testing.random_model import (
        SCALE_CONFIGS,
        SMALL_CONFIGS,
        write_random_model,
    )

    root = Path(tempfile.mkdtemp(prefix="probe-engine-"))
    tok_dir = load_model("smollm2-135m").path
    t0 = time.perf_counter()
    model_dir = write_random_model(
        {**SMALL_CONFIGS, **SCALE_CONFIGS}[model], root / model, tok_dir, seed=0, dtype="bfloat16"
    )
    emit(probe="build", s=time.perf_counter() - t0)
    engine = _engine(model_dir, root / "state")
    tok = engine.tokenizer
    prompt = prompt_text(tok, ctx)
    # hot turns 4-6 repeat 1-3's texts (tail lengths): a first-shape cost shows as 1-3 > 4-6
    turns = [("cold", prompt)] + [(f"hot-{i + 1}", prompt + extension(1 + i % 3)) for i in range(6)]
    for label, text in turns:
        r = engine.generate("bench", text, GenerationParams(max_tokens=1))
        t = r.timings
        work = sum(layer.work_nbytes for layer in engine.agents.hot["bench"].layers or [])
        emit(probe="turn", label=label, ctx=ctx, ttft_s=t.ttft_s, load_s=t.load_s, prefill_s=t.prefill_s,
             save_s=t.save_s, outcome=str(r.outcome), work_bytes=work)  # fmt: skip
    forward_compare(engine, prompt + extension(1))
    if turns_only:
        engine.close()
        return
    # batched decode, steady state (the way benchmarks/gpu.py measures it), beside mlx-lm
    from gpu import mlx_batch_decode, ours_batch_decode

    from langchain_agent_memory.engine import load_model as load

    short = [prompt_text(tok, min(4096, ctx)) + f"\nAgent {i}." for i in range(16)]
    loaded = load(model_dir)
    for b in (1, 4, 16):
        t0 = time.perf_counter()
        ours = ours_batch_decode(model_dir, root / "batches", short[:b], 48)
        t1 = time.perf_counter()
        theirs = mlx_batch_decode(loaded.model, loaded.tokenizer, short[:b], 48)
        emit(probe="batch", b=b, ours_tok_s=ours, mlx_lm_tok_s=theirs, ours_wall_s=t1 - t0,
             mlx_wall_s=time.perf_counter() - t1)  # fmt: skip
    del loaded
    engine.close()
    # warm, step by step, in a new process
    cmd = [sys.executable, __file__, "warm", str(model_dir), str(root / "state"), str(ctx)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    sys.stdout.write(proc.stdout)
    sys.stderr.write(proc.stderr[-4000:])


def forward_compare(engine: Any, text: str, reps: int = 4) -> None:
    """A hot turn's forward pass alone: the same 15 new tokens over the same keys and values,
    through our hot layer caches and through mlx-lm's ``KVCache`` (filled from ours), each
    rolled back after every rep; what the engine adds around it is the rest of ``ttft_s``."""
    from mlx_lm.models.cache import KVCache

    from langchain_agent_memory.engine.model.forward import prefill_chunk
    from langchain_agent_memory.engine.ops.runtime import mx

    layers = engine.agents.hot["bench"].layers
    n = layers[0].offset
    ids = engine.tokenizer.encode(text, add_special_tokens=False)[-15:]
    theirs = []
    for layer in layers:
        w = layer._work
        c = KVCache()
        c.update_and_fetch(mx.contiguous(w.k[:, :, : n - w.start]), mx.contiguous(w.v[:, :, : n - w.start]))
        theirs.append(c)
    mx.eval([c.state for c in theirs])
    model = engine.lm.model
    for rep in range(reps):
        ids = ids[1:] if rep == reps - 1 else ids  # the last rep: a tail length not seen yet
        t0 = time.perf_counter()
        mx.eval(prefill_chunk(model, ids, theirs, last=True))
        t1 = time.perf_counter()
        for c in theirs:
            c.trim(len(ids))
        mx.eval(prefill_chunk(model, ids, layers, last=True))
        t2 = time.perf_counter()
        for layer in layers:  # roll back: this rep's tokens were pending only
            layer.set_pending(None, None)
            layer.offset -= len(ids)
            layer._work.end -= len(ids)
            layer._fetched = None
        emit(probe="forward", rep=rep, ctx=n, mlx_kvcache_s=t1 - t0, ours_layers_s=t2 - t1)
    del theirs
    mx.clear_cache()


def warm_main(model_dir: str, state: str, ctx: int) -> None:
    from gpu import prompt_text
    from peers import extension

    from langchain_agent_memory.engine.engine import GenerationParams
    from langchain_agent_memory.engine.ops.runtime import mx

    t0 = time.perf_counter()
    engine = _engine(Path(model_dir), Path(state))
    emit(probe="warm", step="model load", s=time.perf_counter() - t0)
    prompt = prompt_text(engine.tokenizer, ctx)
    agents = engine.agents
    record = agents.read_record("bench")
    assert record is not None
    n = len(record.token_ids)
    for rep in range(2):
        t0 = time.perf_counter()
        groups = engine.admin.store.blocks.read(record.blocks)
        t1 = time.perf_counter()
        mx.eval([g.tensor(name) for g in groups for name in g.names()[:2]])
        t2 = time.perf_counter()
        emit(probe="warm", rep=rep, step="read_blocks", s=t1 - t0, first_two_tensors_s=t2 - t1)
        del groups
        mx.clear_cache()
        t0 = time.perf_counter()
        layers, _ = agents.from_blocks(record.blocks, n)
        t1 = time.perf_counter()
        mx.eval([layer.state[:4] for layer in layers])
        t2 = time.perf_counter()
        for layer in layers:
            layer._visible(layer.start, layer.dtype, rotated=False)
        mx.eval([layer._work.k for layer in layers] + [layer._work.v for layer in layers])
        t3 = time.perf_counter()
        emit(
            probe="warm",
            rep=rep,
            step="from_blocks",
            build_s=t1 - t0,
            eval_stored_s=t2 - t1,
            working_copy_s=t3 - t2,
        )
        del layers
        mx.clear_cache()
    for rep in range(2):
        engine.admin.drop_hot()
        r = engine.generate("bench", prompt + extension(3 + rep), GenerationParams(max_tokens=1))
        emit(probe="warm", rep=rep, step="generate", ttft_s=r.timings.ttft_s, load_s=r.timings.load_s,
             outcome=str(r.outcome))  # fmt: skip


# ----------------------------------------------------------------------------- restore


def _words(group: Any, name: str) -> Any:
    """``BlockGroup.tensor`` through the blob viewed as the tensor's words (reader.py's CPU path)."""
    from langchain_agent_memory.engine.ops.runtime import mx
    from langchain_agent_memory.engine.storage.reader import _DTYPES

    if not group._entries:
        group._entries.update((e.name, e) for e in group.headers[0].tensors)
    e = group._entries[name]
    dtype = _DTYPES[e.dtype][0]
    w = dtype.size
    rows = mx.view(group.blob, dtype)[:, e.begin // w : e.end // w]
    x = rows.reshape(rows.shape[0], *e.shape)
    b, h, t, d = e.shape
    return mx.moveaxis(x, 0, 2).reshape(b, h, rows.shape[0] * t, d)


def _bytes(group: Any, name: str) -> Any:
    """Only the strided byte slice made contiguous (the first copy of the GPU path)."""
    from langchain_agent_memory.engine.ops.runtime import mx

    if not group._entries:
        group._entries.update((e.name, e) for e in group.headers[0].tensors)
    e = group._entries[name]
    return mx.contiguous(group.blob[:, e.begin : e.end])


def restore_main(ctx: int, model: str, reps: int) -> None:
    """Where a warm restore's layer build goes on the GPU: each way of cutting a read
    group into tensors, timed alone, then ``from_blocks`` whole, in a process that has
    served a 4K agent first (as a server has)."""
    from gpu import prompt_text, random_model_dir

    from langchain_agent_memory.engine.engine import GenerationParams
    from langchain_agent_memory.engine.ops.runtime import mx

    root = Path(tempfile.mkdtemp(prefix="probe-restore-"))
    engine = _engine(random_model_dir(model, root / "model"), root / "state")
    engine.generate("small", prompt_text(engine.tokenizer, 4096), GenerationParams(max_tokens=4))
    engine.generate("bench", prompt_text(engine.tokenizer, ctx), GenerationParams(max_tokens=1))
    engine.flush()
    agents = engine.agents
    record = agents.read_record("bench")
    assert record is not None
    n = len(record.token_ids)

    def timed(fn: Any) -> float:
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        return time.perf_counter() - t0

    for rep in range(reps):
        agents.clear_memory()
        t0 = time.perf_counter()
        groups = engine.admin.store.blocks.read(record.blocks)
        mx.eval([g.blob for g in groups])
        mx.synchronize()
        read_s = time.perf_counter() - t0
        row: dict[str, Any] = {"probe": "restore", "rep": rep, "ctx": n, "read_s": read_s,
                               "groups": [list(g.blob.shape) for g in groups]}  # fmt: skip
        for label, cut in (("as_built", lambda g, k: g.tensor(k)), ("words", _words), ("bytes_only", _bytes)):
            row[f"{label}_s"] = timed(lambda cut=cut, gs=groups: [cut(g, k) for g in gs for k in g.names()])
        tensors = [g.tensor(k) for g in groups for k in g.names()]
        mx.eval(tensors)
        row["concatenate_one_s"] = timed(lambda ts=tensors: [mx.concatenate([t], axis=2) for t in ts])
        tensors = groups = []
        mx.clear_cache()
        agents.clear_memory()
        row["from_blocks_s"] = timed(lambda: [ly.state[:4] for ly in agents.from_blocks(record.blocks, n)[0]])
        row["active_gb"] = mx.get_active_memory() / 1e9
        emit(**row)
        mx.clear_cache()
    engine.close()


def cold_main(ctx: int, model: str, reps: int) -> None:
    """A cold prefill three ways on one loaded model: mlx-lm's ``KVCache`` in 2048-token
    steps (as its ``stream_generate``), the same chunks through our fresh layer caches
    (the model's forward alone), and the engine's whole cold turn (what a user waits for)."""
    from gpu import prompt_text, random_model_dir
    from mlx_lm.models.cache import make_prompt_cache

    from langchain_agent_memory.engine.engine import GenerationParams
    from langchain_agent_memory.engine.model.forward import prefill_chunk
    from langchain_agent_memory.engine.ops.runtime import mx

    root = Path(tempfile.mkdtemp(prefix="probe-cold-"))
    engine = _engine(random_model_dir(model, root / "model"), root / "state")
    lm = engine.lm.model
    step = engine.chunk_tokens

    def chunks(ids: list[int]) -> list[list[int]]:
        return [ids[i : i + step] for i in range(0, len(ids), step)]

    base = prompt_text(engine.tokenizer, ctx)
    for rep in range(reps + 1):  # rep 0: kernels compiled, not reported
        # a text of its own each rep (its first line), so that no turn reuses another's prefix
        text = f"Agent {rep} starts reading.\n" + base
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
        cache = make_prompt_cache(lm)
        mx.synchronize()
        t0 = time.perf_counter()
        for i, part in enumerate(chunks(ids)):
            out = prefill_chunk(lm, part, cache, last=i == len(chunks(ids)) - 1)
        mx.eval(mx.argmax(out))
        t1 = time.perf_counter()
        del cache
        layers = engine.agents.new_layers()
        mx.synchronize()
        t2 = time.perf_counter()
        for i, part in enumerate(chunks(ids)):
            out = prefill_chunk(lm, part, layers, last=i == len(chunks(ids)) - 1)
        mx.eval(mx.argmax(out))
        t3 = time.perf_counter()
        del layers
        mx.clear_cache()
        r = engine.generate(f"cold{rep}", "Twice: " + text, GenerationParams(max_tokens=1))
        if rep:
            emit(probe="cold", rep=rep, ctx=len(ids), chunk=step, mlx_kvcache_s=t1 - t0, our_layers_s=t3 - t2,
                 engine_ttft_s=r.timings.ttft_s, engine_prefill_s=r.timings.prefill_s,
                 outcome=str(r.outcome))  # fmt: skip
        engine.flush()
    engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("upload")
    u.add_argument("--files", type=int, default=128)
    u.add_argument("--size", type=int, default=11_600_000)
    e = sub.add_parser("engine")
    e.add_argument("--ctx", type=int, default=32768)
    e.add_argument("--model", default="llama-3.1-8b")
    e.add_argument("--turns-only", action="store_true")
    rs = sub.add_parser("restore")
    rs.add_argument("--ctx", type=int, default=32768)
    rs.add_argument("--model", default="llama-3.1-8b")
    rs.add_argument("--reps", type=int, default=3)
    cd = sub.add_parser("cold")
    cd.add_argument("--ctx", type=int, default=4096)
    cd.add_argument("--model", default="llama-3.1-8b")
    cd.add_argument("--reps", type=int, default=3)
    w = sub.add_parser("warm")
    w.add_argument("model_dir")
    w.add_argument("state")
    w.add_argument("ctx", type=int)
    args = ap.parse_args()
    if args.cmd == "upload":
        upload(args.files, args.size)
    elif args.cmd == "engine":
        engine_main(args.ctx, args.model, args.turns_only)
    elif args.cmd == "cold":
        cold_main(args.ctx, args.model, args.reps)
    elif args.cmd == "restore":
        restore_main(args.ctx, args.model, args.reps)
    else:
        warm_main(args.model_dir, args.state, args.ctx)


if __name__ == "__main__":
    main()
