"""Agent capacity: how many agents' caches fit in a memory budget.

Two modes:

    .venv/bin/python benchmarks/capacity.py [--budgets-gib 1 4 16]      # parked, from ttft.json
    python3 benchmarks/capacity.py served --out DIR [--budget-gb 24]     # on a GPU (the H200)
    .venv/bin/python benchmarks/capacity.py served-plot [capacity_served.json]

``served`` (``capacity_served.py``): the most agents of 8K tokens that decode together, all
resident, within a GPU memory budget beside the weights, ours (default format and plain q4)
against mlx-lm's bf16 ``BatchGenerator``, measured: active memory, not computed.

Parked mode: 4K, 8K and 16K tokens, 4-bit vs 16-bit KV, ours and the peers, from measured
bytes.

Reads benchmarks/results/ttft.json (run ``benchmarks/ttft.py`` first): each of its rows
saved one agent's state of N tokens and restored it in fresh processes. Measured per
agent: the bytes of its saved state on disk, and of its state held in memory while the
agent is parked (ours: its packed blocks in the hot tier; mlx-lm: its cache arrays;
llama.cpp: ``llama_state_get_size``, what a parked sequence's state takes). Agents per
budget = budget // parked bytes. Beside them, the 16-bit formula (``2 x kv_heads x
head_dim x 2 bytes`` per layer and token, sliding layers capped at their window) that the
reference paper's 0.281x is relative to, and the resident memory one restored agent's
first request added to a fresh process (RSS): the working set of the agent being served
(ours: a full-precision working copy of its K/V; llama.cpp allocates its context's KV
buffer before the clock, so its RSS column misses it), not a per-parked-agent cost.

Writes benchmarks/results/capacity.json and .png.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
LENGTHS = (4096, 8192, 16384)


def fp16_formula_bytes(model: str, n: int) -> int:
    from langchain_agent_memory import load_model

    spec = load_model(model).structure.spec
    return sum(
        layer.kv_heads * (layer.k_head_dim + layer.v_head_dim) * 2 * min(n, layer.window or n)
        for layer in spec.layers
    )


def main() -> None:
    import sys

    if len(sys.argv) > 1 and sys.argv[1] in ("served", "served-plot"):
        sys.path.insert(0, str(HERE))
        from capacity_served import main as served_main

        served_main()
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets-gib", nargs="+", type=float, default=[1, 4, 16])
    a = ap.parse_args()

    from rich.console import Console
    from rich.table import Table

    rows = [r for r in json.loads((RESULTS / "ttft.json").read_text())["rows"] if "skipped" not in r]
    rows = [r for r in rows if r["n"] in LENGTHS]
    if not rows:
        raise SystemExit("no 4K/8K/16K rows in benchmarks/results/ttft.json: run benchmarks/ttft.py first")
    console = Console(width=max(Console().width, 140))
    out: list[dict[str, Any]] = []
    formula: dict[tuple[str, int], int] = {}
    for r in rows:
        key = (r["model"], r["n"])
        if key not in formula:
            formula[key] = fp16_formula_bytes(r["model"], r["tokens"])
        budgets = {f"{b:g} GiB": int(b * (1 << 30) // r["memory_bytes"]) for b in a.budgets_gib}
        out.append(
            {
                "model": r["model"],
                "n": r["n"],
                "tokens": r["tokens"],
                "system": r["system"],
                "disk_bytes": r["disk_bytes"],
                "memory_bytes": r["memory_bytes"],
                "rss_delta_bytes": r["rss_delta_bytes"],
                "fp16_formula_bytes": formula[key],
                "memory_over_fp16_formula": r["memory_bytes"] / formula[key],
                "agents": budgets,
            }
        )

    table = Table(title="agent capacity: parked agents per memory budget, from measured state bytes")
    cols = ["model", "tokens", "system", "disk MB", "parked MB", "parked / fp16 formula", "serving RSS MB"]
    cols += [f"agents in {b:g} GiB" for b in a.budgets_gib]
    for c in cols:
        table.add_column(c, justify="right")
    for r in out:
        cells = [
            r["model"], str(r["tokens"]), r["system"], f"{r['disk_bytes'] / 1e6:.1f}",
            f"{r['memory_bytes'] / 1e6:.1f}", f"{r['memory_over_fp16_formula']:.3f}",
            f"{r['rss_delta_bytes'] / 1e6:.1f}",
        ]  # fmt: skip
        cells += [str(v) for v in r["agents"].values()]
        table.add_row(*cells)
    console.print(table)
    for model, n in formula:
        q4 = next((r for r in out if (r["model"], r["n"], r["system"]) == (model, n, "ours-q4")), None)
        f16 = next((r for r in out if (r["model"], r["n"], r["system"]) == (model, n, "ours-fp16")), None)
        if q4 and f16:
            ratio = f16["memory_bytes"] / q4["memory_bytes"]
            console.print(f"{model} {n}: ours 4-bit parks {ratio:.2f}x the agents of ours 16-bit")
    (RESULTS / "capacity.json").write_text(json.dumps({"budgets_gib": a.budgets_gib, "rows": out}, indent=2))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budget = a.budgets_gib[0]
    models = sorted({r["model"] for r in out})
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        systems = list(dict.fromkeys(r["system"] for r in out if r["model"] == model))
        ns = sorted({r["n"] for r in out if r["model"] == model})
        width = 0.8 / len(systems)
        for i, system in enumerate(systems):
            vals = []
            for n in ns:
                r = next((r for r in out if (r["model"], r["n"], r["system"]) == (model, n, system)), None)
                vals.append(r["agents"][f"{budget:g} GiB"] if r else 0)
            ax.bar([j + i * width for j in range(len(ns))], vals, width, label=system)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(ns))], [f"{n // 1024}K" for n in ns])
        ax.set_xlabel("tokens per agent")
        ax.set_ylabel(f"parked agents in {budget:g} GiB")
        ax.set_yscale("log")
        ax.set_title(model)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / "capacity.png", dpi=120)
    console.print(f"wrote {RESULTS / 'capacity.json'} and capacity.png")


if __name__ == "__main__":
    main()
