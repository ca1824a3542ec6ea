"""CPU speed of two source trees side by side: did a change keep the engine as fast?

Runs, for each tree, in alternating order over several rounds (the machine is shared and
noisy: only ratios from one interleaved run count):

- ``runtime.py``'s worker on each shipped model (fused CPU kernels on, fp32 weights):
  prefill and decode tokens per second of the model alone;
- ``ttft.py``'s ``ours-q4`` rows at one context length: an agent's next turn cold (full
  prefill), warm (a new process reads the state from disk) and hot (in memory);
- with ``--fan-out N``, ``fanout.py``'s map step on the default model: N ``Send`` tasks over
  a stored ~1K-token prefix (the LangGraph fan-out), and the same N calls in turn on one
  agent (each a hot DIVERGE back to the prefix).

    git worktree add /tmp/base <rev>
    .venv/bin/python benchmarks/revisions.py --base /tmp/base --head . --length 4096 [--fan-out 8]

Each tree runs its own ``benchmarks/`` scripts with its own package first on the path.
Writes benchmarks/results/revisions.json and revisions.png; prints a table of medians and
head / base ratios (< 1 is faster for times, > 1 faster for rates).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trees import interleaved, medians, run_in_tree

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
MODELS = ("smollm2-135m", "gemma3-270m")

_TTFT = """
import json, sys
sys.path.insert(0, "benchmarks")
from ttft import measure
row = measure(sys.argv[1], int(sys.argv[2]), ["ours-q4"], lambda n: None)[0]
print(json.dumps({k: row[k] for k in ("cold_s", "warm_s", "hot_s")}))
"""

_FANOUT = """
import json, sys
sys.path.insert(0, "benchmarks")
import fanout
from langchain_agent_memory import corpus, load_model
n = int(sys.argv[1])
tok = load_model("smollm2-135m").tokenizer
text = corpus.apache_license() + "\\n\\n" + corpus.python_docs_topic("while") * 4
prefix = "Answer from this document.\\n\\n" + tok.decode(tok.encode(text, add_special_tokens=False)[:1024])
print(json.dumps({"fanout_s": fanout.fan_out(prefix, n, 16)["wall_s"],
                  "sequential_s": fanout.sequential(prefix, n, 16)["wall_s"]}))
"""

#: metric -> (what it is, higher is better)
METRICS = {
    "prefill_tok_s": ("model prefill, tokens/s", True),
    "decode_tok_s": ("model decode, tokens/s", True),
    "cold_s": ("next turn cold, s", False),
    "warm_s": ("next turn warm, s", False),
    "hot_s": ("next turn hot, s", False),
    "fanout_s": ("fan-out of N Sends over a stored prefix, s", False),
    "sequential_s": ("the same N calls in turn on one agent, s", False),
}
#: The fan-out's cell (not a model: fanout.py runs the default one) and its metrics.
FAN_OUT = "fan-out"
CELL_METRICS = {FAN_OUT: ("fanout_s", "sequential_s")}


def metrics_of(cell: str) -> tuple[str, ...]:
    return CELL_METRICS.get(cell, tuple(k for k in METRICS if k not in CELL_METRICS[FAN_OUT]))


def measure(tree: str, cell: str, length: int, fan_out: int) -> dict[str, float]:
    if cell == FAN_OUT:
        return run_in_tree(tree, ["-c", _FANOUT, str(fan_out)])
    model = cell
    rt = run_in_tree(tree, ["benchmarks/runtime.py", "--worker", "--model", model, "--fast-ops"])
    row = {"prefill_tok_s": rt["prefill_tok_s"], "decode_tok_s": rt["decode_tok_s"]}
    row.update(run_in_tree(tree, ["-c", _TTFT, model, str(length)]))
    return row


def speedup(key: str, ratio: float) -> float:
    """head / base as a speed: > 1 means head is faster (rates as they are, times inverted)."""
    return ratio if METRICS[key][1] else 1 / ratio


def plot(summary: dict[str, dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [
        f"{m.split('-')[0]}\n{k.removesuffix('_s').removesuffix('_tok')}"
        for m in summary
        for k in metrics_of(m)
    ]
    speeds = [speedup(k, summary[m][f"{k}_ratio"]) for m in summary for k in metrics_of(m)]
    fig, ax = plt.subplots(figsize=(max(8, len(labels) * 0.9), 4.5))
    ax.bar(range(len(labels)), speeds, color=["C3" if s < 0.95 else "C2" for s in speeds])
    ax.axhline(1.0, color="black", lw=0.8)
    ax.axhline(0.95, color="grey", lw=0.6, ls=":")
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylabel("speed of head / base (> 1: faster)")
    ax.set_title("CPU speed, head vs base, measured side by side (red: > 5 % slower)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, help="the tree before (required unless --plot-only)")
    ap.add_argument("--head", type=Path, default=HERE.parent)
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--fan-out", type=int, default=0, help="also the fan-out of this many Sends (0: not run)")
    ap.add_argument("--plot-only", action="store_true", help="redraw the plot from revisions.json")
    a = ap.parse_args()
    if a.plot_only:
        plot(json.loads((RESULTS / "revisions.json").read_text())["summary"], RESULTS / "revisions.png")
        return

    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    if a.base is None:
        ap.error("--base is required (a checkout of the tree before: git worktree add /tmp/base <rev>)")
    trees = {"base": str(a.base.resolve()), "head": str(a.head.resolve())}
    cells = [*a.models, *([FAN_OUT] if a.fan_out else [])]
    with Progress() as progress:
        task = progress.add_task("revisions", total=a.rounds * len(cells) * 2)
        rows = interleaved(
            list(trees.values()), cells, a.rounds,
            lambda tree, cell: measure(tree, cell, a.length, a.fan_out), lambda _: progress.advance(task),
        )  # fmt: skip
    meds = {
        key: value
        for cell in cells
        for key, value in medians([r for r in rows if r["cell"] == cell], metrics_of(cell)).items()
    }
    runs = {m: {name: [r for r in rows if r["tree"] == t and r["cell"] == m] for name, t in trees.items()}
            for m in cells}  # fmt: skip

    summary: dict[str, dict[str, float]] = {}
    table = Table(title=f"CPU speed side by side ({a.rounds} rounds, {a.length} tokens; medians)")
    for col in ("model", "metric", "base", "head", "head / base", "speed (> 1: faster)"):
        table.add_column(col)
    for model in cells:
        summary[model] = {}
        for key in metrics_of(model):
            what = METRICS[key][0].replace(" N ", f" {a.fan_out} ")
            base, head = meds[trees["base"], model][key], meds[trees["head"], model][key]
            summary[model].update({f"{key}_base": base, f"{key}_head": head, f"{key}_ratio": head / base})
            speed = speedup(key, head / base)
            table.add_row(model, what, f"{base:.3f}", f"{head:.3f}", f"{head / base:.3f}", f"{speed:.3f}")
    Console().print(table)
    RESULTS.mkdir(exist_ok=True)
    payload = {
        "trees": trees,
        "length": a.length,
        "fan_out": a.fan_out,
        "runs": runs,
        "summary": summary,
    }
    (RESULTS / "revisions.json").write_text(json.dumps(payload, indent=2))
    plot(summary, RESULTS / "revisions.png")


if __name__ == "__main__":
    main()
