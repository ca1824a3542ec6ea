"""Serving agents from their stored form on a GPU, beside a working copy and mlx-lm, in one
run on the lent NVIDIA H200 (mlx's CUDA build).

RANDOM WEIGHTS: a Llama-3.1-8B shape with random bf16 weights (SmolLM2's tokenizer): every
number here is a time or a size, never a quality figure (``pytest -m gpu`` checks quality).

    python3 benchmarks/gpu_served.py run --out DIR [--contexts 32768] [--batches 1,4,16]
    .venv/bin/python benchmarks/gpu_served.py plot [benchmarks/results/gpu_served.json]

Per engine setting (``attention="stored"``: the agent's 4-bit form, no full-precision copy;
``"copy"``: a bf16 working copy beside it) and for mlx-lm (its bf16 ``KVCache``):

- served memory of one agent at each context: mlx's active memory after its warm turn
  (blocks read from disk into a new engine, 15 new tokens, 32 decoded) minus before it,
  and the peak during the turn; mlx-lm: ``load_prompt_cache`` then the same turn;
- warm and hot time to first token, decode tokens/s of that agent alone;
- batched decode at 4K per agent: tokens/s over the steps all members decoded, for each
  batch size (ours: agents cached and hot, one thread each; mlx-lm: ``BatchGenerator``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu import device_name, log, mlx_batch_decode, ours_batch_decode, prompt_text, random_model_dir
from peers import MlxLm, extension

RESULTS = Path(__file__).resolve().parent / "results"
DECODE = 32
SETTINGS = ("stored", "copy")


def _gb(n: float) -> float:
    return round(n / 1e9, 3)


def ours_served(model_dir: Path, root: Path, attention: str, prompt: str) -> dict[str, Any]:
    import mlx.core as mx

    from langchain_agent_memory.engine.engine import Engine, GenerationParams

    where = root / f"{attention}-{len(prompt)}"
    engine = Engine(model_dir, cache_dir=where, kv_bits=4, attention=attention, context_length=1 << 17)
    t0 = time.perf_counter()
    cold = engine.generate("a", prompt, GenerationParams(max_tokens=1))
    cold_wall = time.perf_counter() - t0
    engine.close()
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    engine = Engine(model_dir, cache_dir=where, kv_bits=4, attention=attention, context_length=1 << 17)
    warm = engine.generate("a", prompt + extension(1), GenerationParams(max_tokens=DECODE))
    after = mx.get_active_memory()
    peak = mx.get_peak_memory()
    hot = engine.generate(
        "a", prompt + extension(1) + warm.text + extension(2), GenerationParams(max_tokens=DECODE)
    )
    row = {
        "cold_ttft_s": cold.timings.ttft_s,
        "cold_wall_s": cold_wall,
        "cold_save_s": cold.timings.save_s,
        "warm": str(warm.outcome),
        "warm_ttft_s": warm.timings.ttft_s,
        "hot": str(hot.outcome),
        "hot_ttft_s": hot.timings.ttft_s,
        "decode_tok_s": (hot.completion_tokens - 1) / hot.timings.decode_s,
        "served_bytes": after - before,
        "peak_over_before_bytes": peak - before,
        "working_copy_bytes": engine.stats()["working_copy_bytes"],
    }
    engine.close()
    mx.clear_cache()
    return row


def save_overlap(model_dir: Path, root: Path, long_prompt: str, short_prompt: str) -> dict[str, Any]:
    """Agent A's cold turn over ``long_prompt`` returns, and its save runs on the save thread
    while agent B (hot, ``short_prompt``) decodes: B's tokens/s during A's save against B's
    alone, and A's reply time against its generation time (time to first token)."""
    import threading

    from langchain_agent_memory.engine.engine import Engine, GenerationParams

    engine = Engine(model_dir, cache_dir=root / "overlap", kv_bits=4, context_length=1 << 17)
    engine.generate("b", short_prompt, GenerationParams(max_tokens=1))

    def b_rate(turn: int, n: int) -> list[float]:
        stamps = []
        for _chunk in engine.stream("b", short_prompt + extension(turn), GenerationParams(max_tokens=n)):
            stamps.append(time.perf_counter())
        return stamps

    alone = b_rate(1, 128)
    alone_rate = (len(alone) - 1) / (alone[-1] - alone[0])
    out: dict[str, Any] = {}

    def run_a() -> None:
        t0 = time.perf_counter()
        r = engine.generate("a", long_prompt, GenerationParams(max_tokens=1))
        out["a_returned"] = time.perf_counter()
        out["a_wall_s"] = out["a_returned"] - t0
        out["a_ttft_s"] = r.timings.ttft_s
        out["a_commit_s"] = r.timings.save_s  # on the model's thread, before the reply
        engine.flush()
        out["a_saved"] = time.perf_counter()

    thread = threading.Thread(target=run_a)
    thread.start()
    while "a_returned" not in out and thread.is_alive():
        time.sleep(0.005)
    during = b_rate(2, 1024) if "a_returned" in out else []
    thread.join()
    inside = [t for t in during if t <= out.get("a_saved", 0)]
    engine.close()
    row = {
        "a_wall_s": out.get("a_wall_s"),
        "a_ttft_s": out.get("a_ttft_s"),
        "a_commit_s": out.get("a_commit_s"),
        "a_save_after_reply_s": out.get("a_saved", 0) - out.get("a_returned", 0),
        "b_alone_tok_s": alone_rate,
        "b_tokens_during_save": len(inside),
    }
    if len(inside) > 2:
        row["b_during_save_tok_s"] = (len(inside) - 1) / (inside[-1] - inside[0])
    return row


def mlx_served(model_dir: Path, loaded: Any, root: Path, prompt: str) -> dict[str, Any]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import load_prompt_cache

    peer = MlxLm(model_dir, None, root / f"mlx-{len(prompt)}", loaded=(loaded.model, loaded.tokenizer))
    (root / f"mlx-{len(prompt)}").mkdir(parents=True, exist_ok=True)
    cold = peer.cold(prompt)
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    cache = load_prompt_cache(str(peer.path))
    ids = peer._ids(prompt, 1)[len(peer._ids(prompt)) :]
    count, t1, ttft = 0, 0.0, 0.0
    for _tok, _ in generate_step(mx.array(ids), peer.model, prompt_cache=cache, max_tokens=DECODE):
        count += 1
        if count == 1:
            t1 = time.perf_counter()
            ttft = t1 - t0
    decode = (count - 1) / (time.perf_counter() - t1)
    after = mx.get_active_memory()
    row = {
        "cold_ttft_s": cold["ttft_s"],
        "warm_ttft_s": ttft,
        "decode_tok_s": decode,
        "served_bytes": after - before,
        "peak_over_before_bytes": mx.get_peak_memory() - before,
    }
    del cache
    mx.clear_cache()
    return row


def run(args: argparse.Namespace) -> None:
    import mlx.core as mx

    from langchain_agent_memory.engine import load_model

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "device": device_name(),
        "model": f"{args.model} shape, RANDOM weights, SmolLM2's tokenizer",
        "served": [],
        "batch": [],
    }

    def save() -> None:
        (out_dir / "gpu_served.json").write_text(json.dumps(result, indent=1))

    root = Path(tempfile.mkdtemp(prefix="served-"))
    model_dir = random_model_dir(args.model, root / "model")
    loaded = load_model(model_dir)
    warm_prompt = prompt_text(loaded.tokenizer, args.short)
    for attention in SETTINGS:  # kernels compiled before the clock
        ours_served(model_dir, root / "warmup", attention, warm_prompt)
    mlx_served(model_dir, loaded, root / "warmup", warm_prompt)
    log("warmed up")
    sections = set(args.sections.split(","))
    if "restore" in sections:  # in this process, which has served 4K agents (as a server has)
        from cpu_profile import warm_breakdown

        for ctx in (int(c) for c in args.contexts.split(",")):
            row = warm_breakdown(model_dir, ctx, root / "restore", text=prompt_text(loaded.tokenizer, ctx))
            log(json.dumps(row))
            result.setdefault("restore", []).append(row)
            save()
    for ctx in (int(c) for c in args.contexts.split(",")) if "served" in sections else ():
        prompt = prompt_text(loaded.tokenizer, ctx)
        for system in (*SETTINGS, "mlx-lm"):
            row: dict[str, Any] = {"context": ctx, "system": system}
            try:
                if system == "mlx-lm":
                    row |= mlx_served(model_dir, loaded, root, prompt)
                else:
                    row |= ours_served(model_dir, root, system, prompt)
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"[:500]
            log(json.dumps(row))
            result["served"].append(row)
            save()
    short = prompt_text(loaded.tokenizer, args.short)
    for ctx in (int(c) for c in args.contexts.split(",")) if "overlap" in sections else ():
        try:
            row = {"context": ctx} | save_overlap(model_dir, root, prompt_text(loaded.tokenizer, ctx), short)
        except Exception as exc:
            row = {"context": ctx, "error": f"{type(exc).__name__}: {exc}"[:500]}
        log(json.dumps(row))
        result.setdefault("save_overlap", []).append(row)
        save()
    for b in (int(x) for x in args.batches.split(",")) if "batch" in sections else ():
        prompts = [short + f"\nAgent {i}." for i in range(b)]
        row = {"batch": b}
        try:
            for attention in SETTINGS:
                row[f"ours_{attention}_tok_s"] = ours_batch_decode(
                    model_dir, root / f"b-{attention}", prompts, 64, attention=attention
                )
            row["mlx_lm_tok_s"] = mlx_batch_decode(loaded.model, loaded.tokenizer, prompts, 64)
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:500]
        log(json.dumps(row))
        result["batch"].append(row)
        save()
        mx.clear_cache()


def plot(path: Path) -> None:
    """A table of ``path`` (gpu_served.json) and benchmarks/results/gpu_served.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from rich.console import Console
    from rich.table import Table

    data = json.loads(path.read_text())
    table = Table(title=f"{data['device']}: one served agent ({data['model']})")
    for col in ("context", "system", "served GB", "peak GB", "warm TTFT s", "hot TTFT s", "decode tok/s"):
        table.add_column(col, justify="right")
    rows = [r for r in data["served"] if "error" not in r]
    for r in rows:
        table.add_row(
            str(r["context"]), r["system"],
            str(_gb(r["served_bytes"])), str(_gb(r["peak_over_before_bytes"])),
            f"{r['warm_ttft_s']:.3f}", f"{r.get('hot_ttft_s', float('nan')):.3f}", f"{r['decode_tok_s']:.1f}",
        )  # fmt: skip
    console = Console()
    console.print(table)
    for b in data["batch"]:
        console.print(
            f"batch {b['batch']}: " + ", ".join(f"{k} {v:.0f}" for k, v in b.items() if k != "batch")
        )
    for w in data.get("restore", []):
        console.print(
            f"warm restore of {w['tokens']} tokens, step by step: "
            + json.dumps({k: round(v, 3) for k, v in w.items() if k.endswith("_s")})
        )
    for o in data.get("save_overlap", []):
        console.print(
            f"save overlap at {o['context']}: " + json.dumps({k: round(v, 3) for k, v in o.items()})
        )
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    names = [f"{r['system']}\n{r['context'] // 1024}K" for r in rows]
    for ax, key, label in (
        (axes[0], "served_bytes", "served memory, GB"),
        (axes[1], "warm_ttft_s", "warm time to first token, s"),
        (axes[2], "decode_tok_s", "decode tokens/s (alone)"),
    ):
        vals = [_gb(r[key]) if key.endswith("bytes") else r[key] for r in rows]
        ax.bar(names, vals, color=["tab:green", "tab:blue", "tab:gray"][: len(vals)])
        ax.set_title(label)
    fig.suptitle(f"{data['device']}, {data['model']}: stored form vs working copy vs mlx-lm")
    fig.tight_layout()
    out = RESULTS / "gpu_served.png"
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--contexts", default="32768")
    r.add_argument("--batches", default="1,4,16")
    r.add_argument("--model", default="llama-3.1-8b", help="a random_model config (SCALE_ or SMALL_CONFIGS)")
    r.add_argument("--sections", default="restore,served,overlap,batch")
    r.add_argument("--short", type=int, default=4096, help="tokens per agent of the batches and warm-up")
    p = sub.add_parser("plot")
    p.add_argument("path", nargs="?", default=str(RESULTS / "gpu_served.json"))
    args = ap.parse_args()
    if args.cmd == "run":
        run(args)
    else:
        plot(Path(args.path))


if __name__ == "__main__":
    main()
