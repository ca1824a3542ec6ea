"""Where the CPU time goes: cold prefill chunk by chunk, a warm restore step by step, and
decode against its memory-bandwidth floor, on both shipped models (the profile behind the
CPU-speed work; ``benchmarks/README.md`` says what it found).

    .venv/bin/python -u benchmarks/cpu_profile.py [--models ...] [--prefill-tokens N] [--warm-tokens N ...]

- Prefill: each chunk's time at its position P, for ours (4-bit and 16-bit KV, chunks of
  128 and 512 tokens) and for plain mlx-lm (its model and cache, the same chunks). A chunk
  costs about ``a + b * P``: ``a`` is what does not depend on the context (projections,
  MLP, norms, the commit of the chunk's KV), ``b * P`` the attention over what came before.
  The fit says how much of an N-token prefill is attention.
- Warm restore (in this process, the agent's blocks dropped from memory first, files in
  the page cache as a new process finds them): the block files' headers, reading and
  checking them (SHA-256), uploading, building the layer caches, prefilling the new turn
  and sampling its first token; and the bytes read against the bytes the layers need (a
  sliding-window layer needs only its last window).
- Decode: tokens per second at a 1K context, the bytes each token moves (weights once per
  step, plus the KV read) and this machine's memory bandwidth: their ratio is the floor.
  Bandwidth three ways: a large ``numpy`` copy into fresh memory (the first measure: its
  page faults count), the same copy into memory already touched, and mlx reading a 256 MB
  float32 matrix as decode reads weights (GEMVs), on both cores (two CPU streams). The
  floor is taken from the fastest; the others are kept beside it.

Writes results/profile.json and results/profile.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))


def _text(model: str, n: int) -> str:
    from ttft import prompt_text

    return prompt_text(model, n)


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares ``t = a + b * P`` over (P, t)."""
    xs, ys = [p for p, _ in points], [t for _, t in points]
    mx_, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx_) ** 2 for x in xs) or 1.0
    b = sum((x - mx_) * (y - my) for x, y in zip(xs, ys, strict=True)) / var
    return my - b * mx_, b


def prefill_ours(model: str, n: int, kv_bits: int | None, chunk: int, tmp: Path) -> dict[str, Any]:
    from langchain_agent_memory.engine.engine import Engine, GenerationParams

    engine = Engine(model, cache_dir=tmp / f"p{kv_bits}-{chunk}", kv_bits=kv_bits, chunk_tokens=chunk)
    runner = engine._steps.runner  # this benchmark's own engine: each chunk timed
    plain = runner.prefill
    points: list[tuple[int, float]] = []

    def timed(ids: list[int], layers: list[Any], last: bool) -> Any:
        t0 = time.perf_counter()
        out = plain(ids, layers, last=last)
        if out is not None:
            out.item() if out.size == 1 else out.sum().item()
        points.append((layers[0].offset - len(ids), time.perf_counter() - t0))
        return out

    runner.prefill = timed  # type: ignore[method-assign]
    r = engine.generate("p", _text(model, n), GenerationParams(max_tokens=1))
    engine.close()
    a, b = _fit(points[:-1] or points)
    return {
        "system": f"ours-{'q4' if kv_bits else 'fp16'}", "chunk": chunk, "tokens": r.prompt_tokens,
        "prefill_s": r.timings.prefill_s, "save_s": r.timings.save_s, "chunk_a_s": a,
        "chunk_b_s_per_1k": b * 1000, "points": points,
    }  # fmt: skip


def prefill_mlx(model: str, n: int, chunk: int) -> dict[str, Any]:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from langchain_agent_memory import load_model

    lm = load_model(model, cpu_kernels=False)  # mlx-lm's own modules, as its users run them
    ids = lm.tokenizer.encode(_text(model, n), add_special_tokens=False)
    cache = make_prompt_cache(lm.model)
    points = []
    t_all = time.perf_counter()
    for a in range(0, len(ids), chunk):
        t0 = time.perf_counter()
        out = lm.model(mx.array(ids[a : a + chunk])[None], cache=cache)
        mx.eval(out[:, -1], [c.state for c in cache])
        points.append((a, time.perf_counter() - t0))
    total = time.perf_counter() - t_all
    a_, b_ = _fit(points)
    return {
        "system": "mlx-lm-full", "chunk": chunk, "tokens": len(ids), "prefill_s": total, "save_s": 0.0,
        "chunk_a_s": a_, "chunk_b_s_per_1k": b_ * 1000, "points": points,
    }  # fmt: skip


def warm_breakdown(model: str | Path, n: int, tmp: Path, text: str | None = None) -> dict[str, Any]:
    """A warm restore of an ``n``-token agent step by step (``text``: its context, else the
    first ``n`` tokens of the Python docs), in this process (benchmarks/gpu_served.py runs
    it on a GPU, after the process has served other agents)."""
    from peers import extension

    from langchain_agent_memory.engine.engine import Engine, GenerationParams
    from langchain_agent_memory.engine.storage.blocks import BLOCK_TOKENS
    from langchain_agent_memory.engine.storage.reader import read_header

    engine = Engine(model, cache_dir=tmp / f"w{n}", context_length=4 * n)
    text = text if text is not None else _text(str(model), n)
    engine.generate("w", text, GenerationParams(max_tokens=1))
    record = engine.admin.store.records.get("w")
    assert record is not None
    chain = record.blocks
    rows: dict[str, float] = {}
    for i in range(3):  # the last of 3 (files in the page cache, code warmed up)
        engine.admin.set_agent(f"w{i}", record)  # a fork of the context: its blocks, shared
        engine.admin.clear_memory()
        t0 = time.perf_counter()
        headers = [read_header(engine.admin.store.blocks.path(h)) for h in chain]
        t1 = time.perf_counter()
        groups = engine.admin.store.blocks.read(chain)
        import mlx.core as mx

        mx.eval([g.blob for g in groups])
        read_s = time.perf_counter() - t1
        del groups
        engine.admin.clear_memory()
        t2 = time.perf_counter()
        layers, _ = engine.agents.from_blocks(chain, len(record.token_ids))  # reads them again
        mx.eval([layer.state for layer in layers])
        t3 = time.perf_counter()
        del layers
        engine.admin.clear_memory()
        r = engine.generate(f"w{i}", text + extension(0), GenerationParams(max_tokens=1))
        rows = {
            "headers_s": t1 - t0, "read_check_upload_s": read_s,
            "from_blocks_s": t3 - t2, "build_layers_s": max(0.0, t3 - t2 - read_s),
            "engine_load_s": r.timings.load_s, "tail_prefill_and_first_token_s": r.timings.prefill_s,
            "ttft_s": r.timings.ttft_s, "tail_tokens": r.prompt_tokens - r.reused_tokens,
        }  # fmt: skip
    file_bytes = sum(h.data_len for h in headers)
    # What the layers need: every block for a full layer, the last window's for a sliding one.
    spec = engine.spec
    per_layer = file_bytes / max(1, len(spec.layers))
    needed = 0.0
    for layer in spec.layers:
        if layer.window is None:
            needed += per_layer
        else:
            first = max(0, len(record.token_ids) - layer.window) // BLOCK_TOKENS
            needed += per_layer * (len(chain) - first) / len(chain)
    engine.close()
    return {"model": str(model), "tokens": len(record.token_ids), "blocks": len(chain),
            "bytes_read": file_bytes, "bytes_needed": int(needed), **rows}  # fmt: skip


def decode_floor(model: str, tmp: Path) -> dict[str, Any]:
    from mlx.utils import tree_flatten

    from langchain_agent_memory.engine.engine import Engine, GenerationParams

    engine = Engine(model, cache_dir=tmp / "d")
    r = engine.generate("d", _text(model, 1024), GenerationParams(max_tokens=64, stop=[]))
    tok_s = r.completion_tokens / r.timings.decode_s
    weights = sum(v.nbytes for _, v in tree_flatten(engine.lm.model.parameters()))
    layers = engine.agents.hot["d"].layers or []
    kv = sum(layer.nbytes for layer in layers)
    work = sum(layer.work_nbytes for layer in layers)
    engine.close()
    ways = bandwidths()
    bandwidth = max(ways.values())
    moved = weights + (work or kv)
    return {"model": model, "tokens_per_s": tok_s, "weight_bytes": weights, "kv_bytes": kv,
            "work_bytes": work, "bytes_per_token": moved, "bandwidth_gb_s": bandwidth / 1e9,
            "bandwidths_gb_s": {k: v / 1e9 for k, v in ways.items()},
            "floor_tokens_per_s": bandwidth / moved, "of_floor": tok_s / (bandwidth / moved)}  # fmt: skip


def bandwidths() -> dict[str, float]:
    """Bytes per second, best of five: a 256 MB copy (read + write counted) into fresh memory
    and into touched memory; mlx's GEMVs reading a 256 MB float32 matrix, its two row halves
    on two CPU streams (both cores: one GEMV runs on one core)."""
    import mlx.core as mx
    import numpy as np

    big = np.ones(1 << 28, np.uint8)  # 256 MB: past every cache
    dst = np.zeros_like(big)
    out = {"copy_fresh": 2 * big.nbytes / min(_timed(lambda: big.copy()) for _ in range(5))}
    out["copy_touched"] = 2 * big.nbytes / min(_timed(lambda: np.copyto(dst, big)) for _ in range(5))
    w = mx.random.normal((1 << 16, 1 << 10), key=mx.random.key(0))
    x = mx.random.normal((1, 1 << 10), key=mx.random.key(1))
    side = mx.new_stream(mx.cpu)
    h = w.shape[0] // 2
    mx.eval(w, x)

    def gemvs() -> None:
        a = x @ w[:h].T
        with mx.stream(side):
            b = x @ w[h:].T
        mx.eval(a, b)

    gemvs()
    out["gemv_two_cores"] = w.nbytes / min(_timed(gemvs) for _ in range(5))
    return out


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = out["prefill"]
    models = sorted({r["model"] for r in runs})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        for r in runs:
            if r["model"] == model:
                xs = [p for p, _ in r["points"]]
                ys = [1000 * t / max(1, r["chunk"]) * 128 for _, t in r["points"]]
                ax.plot(xs, ys, label=f"{r['system']} chunk {r['chunk']}")
        ax.set_title(f"{model}: prefill time per 128 tokens vs position")
        ax.set_xlabel("position (tokens before the chunk)")
        ax.set_ylabel("ms per 128 tokens")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    ap.add_argument("--prefill-tokens", type=int, default=4096)
    ap.add_argument("--chunks", nargs="+", type=int, default=[128, 512])
    ap.add_argument("--warm-tokens", nargs="+", type=int, default=[1024, 8192])
    ap.add_argument("--skip", nargs="*", default=[], choices=["prefill", "warm", "decode"])
    a = ap.parse_args()
    out: dict[str, Any] = {"prefill": [], "warm": [], "decode": []}
    RESULTS.mkdir(exist_ok=True)

    def save() -> None:  # after every step: a long run keeps what it measured
        (RESULTS / "profile.json").write_text(json.dumps(out, indent=1))

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for model in a.models:
            if "prefill" not in a.skip:
                for chunk in a.chunks:
                    for kv in (4, None):
                        print(f"[prefill] {model} ours kv={kv} chunk={chunk} ...", flush=True)
                        out["prefill"].append(
                            {"model": model, **prefill_ours(model, a.prefill_tokens, kv, chunk, tmp)}
                        )
                    print(f"[prefill] {model} mlx-lm chunk={chunk} ...", flush=True)
                    out["prefill"].append({"model": model, **prefill_mlx(model, a.prefill_tokens, chunk)})
                    save()
            if "warm" not in a.skip:
                for n in a.warm_tokens:
                    print(f"[warm] {model} {n} ...", flush=True)
                    out["warm"].append(warm_breakdown(model, n, tmp))
                    save()
            if "decode" not in a.skip:
                print(f"[decode] {model} ...", flush=True)
                out["decode"].append(decode_floor(model, tmp))
                save()
    print("\nprefill: chunk time = a + b * position")
    print(f"{'model':14} {'system':12} {'chunk':>5} {'tokens':>6} {'prefill s':>9} {'save s':>7} "
          f"{'a ms':>7} {'b ms/1K':>8} {'attention %':>11}")  # fmt: skip
    for r in out["prefill"]:
        pts = r["points"]
        attn = sum(r["chunk_b_s_per_1k"] / 1000 * p for p, _ in pts)
        share = 100 * attn / max(1e-9, sum(t for _, t in pts))
        a_ms, b_ms = 1000 * r["chunk_a_s"], 1000 * r["chunk_b_s_per_1k"]
        print(f"{r['model']:14} {r['system']:12} {r['chunk']:>5} {r['tokens']:>6} {r['prefill_s']:>9.2f} "
              f"{r['save_s']:>7.3f} {a_ms:>7.1f} {b_ms:>8.2f} {share:>10.0f}%")  # fmt: skip
    print("\nwarm restore (seconds)")
    for r in out["warm"]:
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}))
    print("\ndecode")
    for r in out["decode"]:
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}))
    if out["prefill"]:
        plot(out, RESULTS / "profile.png")


if __name__ == "__main__":
    main()
