"""Sliding-window layers at scale on a GPU: a long cold prefill through the engine, two
source trees side by side (did a change to the sliding layers' working copies pay?).

Model: Gemma 3 4B's published shape (``random_model.SCALE_CONFIGS["gemma-3-4b"]``: 34
layers, 29 of them sliding with a 1,024-token window) with RANDOM WEIGHTS (bf16, seeded;
SmolLM2's tokenizer): timings and memory only, never quality. For each context and round
every tree runs in a process of its own, in alternating order, its own package first on
the path: a short turn first (kernels compiled), then the timed cold turn of an agent
(prefill, save, and the peak of mlx's memory over what the engine held before it), then a
hot turn on the same agent.

    # on the H200, after benchmarks/gpu.py's install; BASE: a checkout of the tree before
    python3 benchmarks/gpu_sliding.py run --trees BASE . --contexts 32768,65536 --out $OUT
    .venv/bin/python benchmarks/gpu_sliding.py plot     # results/gpu_sliding.json -> .png

Writes ``gpu_sliding.json`` and ``gpu_sliding.png`` into ``--out`` (run) or next to the
JSON (plot) and prints a table of medians.
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
from trees import interleaved, run_in_tree
from trees import medians as per_tree_medians

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

_WORKER = """
import json, sys, tempfile, time
sys.path.insert(0, sys.argv[1])
from langchain_agent_memory import corpus, load_model
from langchain_agent_memory.engine.engine import Engine, GenerationParams
from langchain_agent_memory.engine.ops.runtime import mx

model_dir, n = sys.argv[2], int(sys.argv[3])
tok = load_model("smollm2-135m").tokenizer
ids = tok.encode(corpus.python_docs(), add_special_tokens=False)
text = tok.decode((ids * (1 + n // len(ids)))[:n])
one = GenerationParams(max_tokens=1)
with tempfile.TemporaryDirectory() as d:
    engine = Engine(model_dir, cache_dir=d, kv_bits=4, context_length=n + 1024)
    engine.generate("warm-up", text[:4000], one)
    mx.synchronize()
    mx.clear_cache()
    resting = mx.get_active_memory()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    cold = engine.generate("agent", text, one)
    cold_s = time.perf_counter() - t0
    peak = mx.get_peak_memory()
    hot = engine.generate("agent", text + " And then", one)
    engine.close()
print(json.dumps({
    "tokens": cold.prompt_tokens, "cold_s": cold_s, "prefill_s": cold.timings.prefill_s,
    "save_s": cold.timings.save_s, "peak_gb": (peak - resting) / 1e9, "resting_gb": resting / 1e9,
    "hot_ttft_s": hot.timings.ttft_s, "hot": str(hot.outcome),
}))
"""

METRICS = ("prefill_s", "save_s", "peak_gb", "hot_ttft_s")


def run(args: argparse.Namespace) -> None:
    from langchain_agent_memory.engine import load_model
    from langchain_agent_memory.testing import random_model

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="gpu-sliding-"))
    t0 = time.perf_counter()
    tok_dir = load_model("smollm2-135m").path
    config = {**random_model.SMALL_CONFIGS, **random_model.SCALE_CONFIGS}[args.shape]
    model_dir = random_model.write_random_model(config, root / args.shape, tok_dir, seed=0, dtype="bfloat16")
    trees = [str(Path(t).resolve()) for t in args.trees]
    result: dict[str, Any] = {
        "model": f"{args.shape} (RANDOM WEIGHTS, bf16)",
        "build_s": time.perf_counter() - t0,
        "trees": trees,
        "rows": [],
    }

    def cold_turn(tree: str, ctx: int) -> dict[str, Any]:
        return run_in_tree(tree, ["-c", _WORKER, tree, str(model_dir), str(ctx)])

    def keep(row: dict[str, Any]) -> None:
        row["context"] = row.pop("cell")
        print(f"[{time.strftime('%H:%M:%S')}] {json.dumps(row)}", flush=True)
        result["rows"].append(row)
        (out_dir / "gpu_sliding.json").write_text(json.dumps(result, indent=1))

    contexts = [int(c) for c in args.contexts.split(",")]
    interleaved(trees, contexts, args.rounds, cold_turn, keep)
    table(result)
    plot(result, out_dir / "gpu_sliding.png")


def medians(result: dict[str, Any]) -> list[dict[str, Any]]:
    rows = [{**r, "cell": r["context"]} for r in result["rows"]]
    meds = per_tree_medians(rows, METRICS)
    order = sorted(meds, key=lambda key: (key[1], result["trees"].index(key[0])))
    return [{"tree": t, "context": c, **meds[t, c]} for t, c in order]


def table(result: dict[str, Any]) -> None:
    print(f"\n{result['model']}: a cold turn, medians over the rounds")
    print(f"{'tree':<28}{'context':>9}{'prefill s':>11}{'save s':>9}{'peak GB':>9}{'hot TTFT s':>12}")
    for m in medians(result):
        name = Path(m["tree"]).name[:26]
        print(
            f"{name:<28}{m['context']:>9}{m['prefill_s']:>11.2f}{m['save_s']:>9.2f}"
            f"{m['peak_gb']:>9.2f}{m['hot_ttft_s']:>12.3f}"
        )


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = medians(result)
    trees = result["trees"]
    contexts = sorted({m["context"] for m in rows})
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    for ax, metric, label in ((axes[0], "peak_gb", "peak memory of the cold turn (GB)"),
                              (axes[1], "prefill_s", "prefill (s)")):  # fmt: skip
        for i, tree in enumerate(trees):
            by_context = {m["context"]: m[metric] for m in rows if m["tree"] == tree}
            values = [by_context.get(c, 0) for c in contexts]
            ax.bar([x + 0.4 * i for x in range(len(contexts))], values, 0.4, label=Path(tree).name)
        ax.set_xticks([x + 0.2 for x in range(len(contexts))], [f"{c:,} tokens" for c in contexts])
        ax.set_ylabel(label)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{result['model']}: sliding layers' working copies", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="measure (on the GPU machine)")
    r.add_argument("--trees", nargs="+", required=True, help="source trees, the base first")
    r.add_argument("--contexts", default="32768,65536")
    r.add_argument("--rounds", type=int, default=2)
    r.add_argument("--shape", default="gemma-3-4b", help="a random_model config (gemma3_text: a smoke test)")
    r.add_argument("--out", default=str(RESULTS))
    p = sub.add_parser("plot", help="table and PNG from a JSON")
    p.add_argument("path", nargs="?", default=str(RESULTS / "gpu_sliding.json"))
    args = ap.parse_args()
    if args.cmd == "run":
        run(args)
    else:
        result = json.loads(Path(args.path).read_text())
        table(result)
        plot(result, Path(args.path).with_suffix(".png"))


if __name__ == "__main__":
    main()
