"""One layer's decode attention over an agent's stored form on the H200: the CUDA kernel
(``kv.stored_cuda``) against the path it replaces (the body decoded to bf16 for the call,
then products) and against mlx's fused attention over a bf16 working copy.

Shapes of a Llama-3.1-8B layer (32 query heads, 8 KV heads of 128), RANDOM keys and
values: times only. Per context and batch (agents decoding one token each), ms per call
after a warm-up, and the kernel's largest difference from the decoded path.

    python3 benchmarks/gpu_kernel.py run --out DIR
    .venv/bin/python benchmarks/gpu_kernel.py plot [benchmarks/results/gpu_kernel.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
HEADS, KV_HEADS, DIM, HEAD_TOKENS = 32, 8, 128, 4
FORMATS = ("k6v4-rot-h4", "q4")
PATHS = ("kernel", "decoded", "bf16-copy")


def _time(fn: Any, repeats: int = 30) -> float:
    import mlx.core as mx

    for _ in range(3):
        mx.eval(fn())
    t0 = time.perf_counter()
    for _ in range(repeats):
        mx.eval(fn())
    return (time.perf_counter() - t0) / repeats * 1e3


def measure(fmt: str, context: int, batch: int) -> dict[str, Any]:
    import mlx.core as mx

    from langchain_agent_memory.engine.kv import FULL, KV_PRESETS, stored_cuda
    from langchain_agent_memory.engine.kv.stored import stored_attention

    quant = KV_PRESETS[fmt]
    k1, k2, k3 = mx.random.split(mx.random.key(1), 3)
    k = mx.random.normal((batch, KV_HEADS, context, DIM), key=k1).astype(mx.bfloat16)
    v = mx.random.normal((batch, KV_HEADS, context, DIM), key=k2).astype(mx.bfloat16)
    q = mx.random.normal((batch, HEADS, 1, DIM), key=k3).astype(mx.bfloat16)
    head = HEAD_TOKENS if quant.head_tokens else 0
    body = slice(head, context - 1)
    segments = []
    if head:
        segments.append(((k[:, :, :head],), (v[:, :, :head],), FULL, FULL))
    segments.append(
        (quant.keys.encode(k[:, :, body]), quant.values.encode(v[:, :, body]), quant.keys, quant.values)
    )
    segments.append(((k[:, :, -1:],), (v[:, :, -1:],), FULL, FULL))
    mx.eval(segments)
    scale = DIM**-0.5
    first = context - 1
    row: dict[str, Any] = {"format": fmt, "context": context, "batch": batch}
    out = {}
    rows_max = stored_cuda.MAX_ROWS
    for path in PATHS:
        if path == "bf16-copy":
            fn = lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)  # noqa: E731
        else:
            # The decoded path: this benchmark's own switch (no call takes the kernel).
            stored_cuda.MAX_ROWS = rows_max if path == "kernel" else 0
            fn = lambda: stored_attention(q, segments, scale, first, 0, None)  # noqa: E731
        try:
            row[f"{path}_ms"] = _time(fn)
            out[path] = fn().astype(mx.float32)
        except Exception as exc:  # a path this device lacks: say so, go on
            row[f"{path}_error"] = f"{type(exc).__name__}: {exc}"[:300]
        stored_cuda.MAX_ROWS = rows_max
    if "kernel" in out and "decoded" in out:
        row["kernel_vs_decoded_max_abs"] = mx.abs(out["kernel"] - out["decoded"]).max().item()
    return row


def run(args: argparse.Namespace) -> None:
    import mlx.core as mx

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "device": mx.device_info().get("device_name", str(mx.default_device())),
        "shape": "Llama-3.1-8B layer (32 heads, 8 KV heads x 128), RANDOM keys and values",
        "rows": [],
    }
    for fmt in FORMATS:
        for context in map(int, args.contexts.split(",")):
            for batch in map(int, args.batches.split(",")):
                row = measure(fmt, context, batch)
                print(json.dumps(row), flush=True)
                result["rows"].append(row)
                (out / "gpu_kernel.json").write_text(json.dumps(result, indent=1))
                mx.clear_cache()


def plot(path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from rich.console import Console
    from rich.table import Table

    data = json.loads(path.read_text())
    table = Table(title=f"{data['device']}: one layer's decode attention, ms per call ({data['shape']})")
    for col in ("format", "context", "batch", *PATHS, "kernel / bf16 copy", "max |kernel - decoded|"):
        table.add_column(col, justify="right")
    for r in data["rows"]:
        ms = [r.get(f"{p}_ms") for p in PATHS]
        ratio = f"{ms[0] / ms[2]:.2f}" if ms[0] and ms[2] else "-"
        diff = r.get("kernel_vs_decoded_max_abs", float("nan"))
        cells = (f"{m:.3f}" if m else "-" for m in ms)
        table.add_row(r["format"], str(r["context"]), str(r["batch"]), *cells, ratio, f"{diff:.1e}")
    Console().print(table)
    fig, axes = plt.subplots(1, len(FORMATS), figsize=(6 * len(FORMATS), 4), squeeze=False)
    for ax, fmt in zip(axes[0], FORMATS, strict=True):
        rows = [r for r in data["rows"] if r["format"] == fmt]
        names = [f"{r['context'] // 1024}K x{r['batch']}" for r in rows]
        width = 0.27
        for i, p in enumerate(PATHS):
            ax.bar(
                [j + (i - 1) * width for j in range(len(rows))],
                [r.get(f"{p}_ms") or 0 for r in rows],
                width,
                label=p,
            )
        ax.set_xticks(range(len(rows)), names)
        ax.set_ylabel("ms per layer call")
        ax.set_title(fmt)
        ax.legend()
    fig.suptitle(f"{data['device']}: decode attention over the stored form")
    fig.tight_layout()
    target = RESULTS / "gpu_kernel.png"
    fig.savefig(target, dpi=110)
    print(f"wrote {target}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--contexts", default="4096,16384,32768")
    r.add_argument("--batches", default="1,16")
    p = sub.add_parser("plot")
    p.add_argument("path", nargs="?", default=str(RESULTS / "gpu_kernel.json"))
    args = ap.parse_args()
    if args.cmd == "run":
        run(args)
    else:
        plot(Path(args.path))


if __name__ == "__main__":
    main()
