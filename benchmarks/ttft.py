"""Time to first token of an agent's next turn: cold (full prefill) / warm (the agent's
state read from disk by a new process) / hot (state in memory), at 1K-16K tokens of real
text, on both shipped models, 4-bit and 16-bit KV: ours beside the peers in the same run
(``benchmarks/peers.py``: mlx-lm's ``save_prompt_cache`` / ``load_prompt_cache``, llama.cpp's
``llama_state_save_file`` / ``llama_state_load_file``), with the bytes of each saved state.

    .venv/bin/python benchmarks/ttft.py                     # 1K..16K, both models, all systems
    .venv/bin/python benchmarks/ttft.py --lengths 1024 2048 --models smollm2-135m --systems ours-q4
    .venv/bin/python benchmarks/ttft.py --states /tmp/states   # keep states; a rerun measures warm only

Context: the first N tokens of the Python reference manual (CPython's pydoc_data), as plain
text, the same for every system. Cold: the first request, which builds the state that is
then saved. Hot (median of 3) and warm (median of 2, each in a new process that loads the
model before the clock starts): the context plus a ~15-token new turn, on the saved state
(see ``peers``). SmolLM2's trained context is 8,192 tokens: its 16K rows run past it (RoPE
extrapolated) and are marked so. llama.cpp needs ``benchmarks/setup_peers.sh``; without it
its rows are skipped. Writes benchmarks/results/ttft.json (after every length: a long run
keeps what it measured) and ttft.png.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))
#: system -> (kind, KV setting)
SYSTEMS: dict[str, tuple[str, Any]] = {
    "ours-q4": ("ours", 4),
    "ours-fp16": ("ours", None),
    "mlx-lm-q4": ("mlx-lm", 4),
    "mlx-lm-full": ("mlx-lm", None),
    "llama.cpp-q4_0": ("llama.cpp", "q4_0"),
    "llama.cpp-f16": ("llama.cpp", "f16"),
}
HOT_RUNS, WARM_RUNS = 3, 2


def prompt_text(model: str, n_tokens: int) -> str:
    from langchain_agent_memory import corpus, load_model

    tok = load_model(model).tokenizer
    ids = tok.encode(corpus.python_docs(), add_special_tokens=False)[:n_tokens]
    return tok.decode(ids)


def gguf_of(model: str) -> Path:
    from langchain_agent_memory.config import get_settings
    from langchain_agent_memory.engine.model.loading import SHIPPED_MODELS

    return SHIPPED_MODELS[model].locate(Path(get_settings().cache_dir))[0]


def applies(system: str, model: str) -> str | None:
    """Why ``system`` cannot run on ``model`` here, or None."""
    from peers import llama_cpp_available

    kind, kv = SYSTEMS[system]
    if kind == "mlx-lm" and kv is not None and model.startswith("gemma3"):
        return "mlx-lm cannot quantize Gemma 3's rotating (sliding-window) caches"
    if kind == "llama.cpp" and not llama_cpp_available():
        return "llama-cpp-python not installed (benchmarks/setup_peers.sh)"
    return None


def make(system: str, model: str, state_dir: Path, context: int) -> Any:
    from peers import LlamaCpp, MlxLm, Ours

    from langchain_agent_memory import load_model

    kind, kv = SYSTEMS[system]
    if kind == "ours":
        return Ours(model, kv, state_dir, context)
    if kind == "mlx-lm":
        return MlxLm(load_model(model).path, kv, state_dir)
    return LlamaCpp(gguf_of(model), kv, state_dir, context)


def warm(system: str, model: str, state_dir: Path, context: int, prompt: str, i: int) -> dict[str, Any]:
    """One warm request in a new process (this script with ``--worker``)."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(prompt)
    cmd = [sys.executable, __file__, "--worker", system, model, str(state_dir), str(context), f.name, str(i)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    Path(f.name).unlink()
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def worker(system: str, model: str, state_dir: str, context: str, prompt_file: str, i: str) -> dict[str, Any]:
    from peers import LlamaCpp, MlxLm, Ours

    from langchain_agent_memory import load_model

    kind, kv = SYSTEMS[system]
    prompt, d = Path(prompt_file).read_text(), Path(state_dir)
    if kind == "ours":
        return Ours.warm(model, kv, d, int(context), prompt, int(i))
    if kind == "mlx-lm":
        return MlxLm.warm(load_model(model).path, kv, d, prompt, int(i))
    return LlamaCpp.warm(gguf_of(model), kv, d, int(context), prompt, int(i))


def measure(
    model: str, n: int, systems: list[str], progress: Any, states: Path | None = None
) -> list[dict[str, Any]]:
    """Each system's cold, hot and warm times at ``n`` tokens. ``states``: keep each built state
    there, and where one was kept by an earlier run, reuse it (its cold and hot times) and
    measure warm again only (a long cold prefill is then paid once)."""
    prompt = prompt_text(model, n)
    context = n + 256  # the prompt, the new turn and tokenizer differences
    rows = []
    for system in systems:
        why = applies(system, model)
        if why is not None:
            rows.append({"model": model, "n": n, "system": system, "skipped": why})
            progress(3)
            continue
        with contextlib.ExitStack() as stack:
            if states is None:
                where = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            else:
                where = states / model / str(n) / system
                where.mkdir(parents=True, exist_ok=True)
            built = where / "built.json"
            if built.exists():
                kept = json.loads(built.read_text())
                cold, hot = kept["cold"], kept["hot"]
                progress(2)
            else:
                obj = make(system, model, where, context)
                # mlx-lm's 4-bit prefill takes 745 s at 8K on SmolLM2 (~50 min at 16K): past
                # 8K its state is built at full precision and quantized, its cold time not taken.
                slow = system == "mlx-lm-q4" and n > 8192
                cold = obj.cold(prompt, prefill_16bit=True) if slow else obj.cold(prompt)
                progress(1)
                hot = [obj.hot(prompt, i)["ttft_s"] for i in range(HOT_RUNS)]
                progress(1)
                if hasattr(obj, "close"):
                    obj.close()  # free its memory: warm processes and later systems need it
                del obj
                if states is not None:
                    built.write_text(json.dumps({"cold": cold, "hot": hot}))
            warms = [warm(system, model, where, context, prompt, i) for i in range(WARM_RUNS)]
            progress(1)
        row = {
            "model": model,
            "n": n,
            "system": system,
            "tokens": cold["tokens"],
            "cold_s": cold["ttft_s"],
            "hot_s": statistics.median(hot),
            "warm_s": statistics.median(w["ttft_s"] for w in warms),
            "hot_runs": hot,
            "warm_runs": [w["ttft_s"] for w in warms],
            # a new process's construction (model load; llama.cpp also allocates its KV buffer
            # for the whole context there), before warm's clock starts
            "start_s": statistics.median(w.get("start_s", 0.0) for w in warms),
            # resident memory one restored agent added to a fresh process (median)
            "rss_delta_bytes": statistics.median(w["rss_delta_bytes"] for w in warms),
            "disk_bytes": cold["disk_bytes"],
            "memory_bytes": cold["memory_bytes"],
            "beyond_trained_context": n > 8192 and model.startswith("smollm2"),
        }
        row["cold_over_warm"] = row["cold_s"] / row["warm_s"] if row["cold_s"] else None
        row["cold_over_hot"] = row["cold_s"] / row["hot_s"] if row["cold_s"] else None
        rows.append(row)
    return rows


def plot(rows: list[dict], path: Path) -> None:
    """Per model: warm (solid) and hot (dotted) time to first token per system, and cold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    systems = [s for s in SYSTEMS if any(r["system"] == s for r in rows)]
    colors = {s: f"C{i}" for i, s in enumerate(SYSTEMS)}
    fig, axes = plt.subplots(2, len(models), figsize=(6.5 * len(models), 8), squeeze=False)
    for col, model in enumerate(models):
        top, bottom = axes[0][col], axes[1][col]
        for system in systems:
            sel = [r for r in rows if (r["model"], r["system"]) == (model, system)]
            sel.sort(key=lambda r: r["n"])
            if not sel:
                continue
            xs = [r["tokens"] for r in sel]
            c = colors[system]
            top.plot(xs, [r["warm_s"] for r in sel], "-", color=c, marker="o", label=f"{system} warm")
            top.plot(xs, [r["hot_s"] for r in sel], ":", color=c, marker=".", label=f"{system} hot")
            cold = [(x, r["cold_s"]) for x, r in zip(xs, sel, strict=True) if r["cold_s"]]
            bottom.plot(*zip(*cold, strict=True), "-", color=c, marker="o", label=system)
        for ax, what in ((top, "warm / hot"), (bottom, "cold")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("prompt tokens")
            ax.set_ylabel(f"{what} time to first token (s)")
            ax.set_title(f"{model}: {what}")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    ap.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    ap.add_argument(
        "--states", type=Path, help="keep built states here; reuse kept ones (warm measured again only)"
    )
    ap.add_argument(
        "--out", default="ttft", help="results/OUT.json and OUT.png (another name keeps a run apart)"
    )
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(*a.worker)))
        return

    from report import _num
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    console = Console(width=max(Console().width, 130))
    rows: list[dict] = []
    with Progress(console=console) as progress:
        task = progress.add_task("ttft", total=len(a.models) * len(a.lengths) * len(a.systems) * 3)
        for model in a.models:
            for n in a.lengths:
                progress.update(task, description=f"{model} {n} tokens")
                new = measure(model, n, a.systems, lambda k: progress.advance(task, k), a.states)
                for r in new:
                    if "skipped" not in r:
                        progress.console.print(
                            f"{model} {r['tokens']:>6} {r['system']:<15} cold {_num(r['cold_s'], '7.2f')} s  "
                            f"warm {r['warm_s']:6.3f} s  hot {r['hot_s']:6.3f} s"
                        )
                rows += new
                write(rows, a.out)

    rows = write(rows, a.out)  # every length measured so far, this run's and earlier runs'
    measured = [r for r in rows if "skipped" not in r]
    table = Table(title="time to first token, seconds (hot: median of 3, warm: median of 2)")
    for c in ("model", "tokens", "system", "cold", "warm", "hot", "cold/warm", "cold/hot", "disk MB",
              "vs ours-q4 warm", "start+warm"):  # fmt: skip
        table.add_column(c, justify="right")
    for r in measured:
        key = (r["model"], r["n"], "ours-q4")
        ours = next((o for o in measured if (o["model"], o["n"], o["system"]) == key), None)
        vs = f"{r['warm_s'] / ours['warm_s']:.1f}x" if ours else "-"
        mark = "*" if r["beyond_trained_context"] else ""
        table.add_row(
            r["model"], f"{r['tokens']}{mark}", r["system"], _num(r["cold_s"], ".2f"), f"{r['warm_s']:.3f}",
            f"{r['hot_s']:.3f}", _num(r["cold_over_warm"], ".0f", "x"), _num(r["cold_over_hot"], ".0f", "x"),
            f"{r['disk_bytes'] / 1e6:.1f}", vs,
            f"{r['start_s'] + r['warm_s']:.3f}" if r.get("start_s") else "-",
        )  # fmt: skip
    console.print(table)
    console.print("* past SmolLM2's trained context (8,192 tokens)")
    for r in rows:
        if "skipped" in r:
            console.print(f"skipped {r['system']} on {r['model']}: {r['skipped']}")
    plot(measured, RESULTS / f"{a.out}.png")
    console.print(f"wrote {RESULTS / a.out}.json and {a.out}.png")


def write(rows: list[dict], name: str = "ttft") -> list[dict]:
    """Merge ``rows`` into results/``name``.json (a row per model, length and system: a run of
    some lengths replaces those and keeps the others). Returns every row, sorted."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    old = json.loads(path.read_text()).get("rows", []) if path.exists() else []
    key = lambda r: (r["model"], r.get("n", r.get("tokens")), r["system"])  # noqa: E731
    merged = {key(r): r for r in old if "system" in r} | {key(r): r for r in rows}
    order = list(SYSTEMS)
    every = sorted(merged.values(), key=lambda r: (r["model"], r["n"], order.index(r["system"])))
    path.write_text(json.dumps({"rows": every}, indent=2))
    return every


if __name__ == "__main__":
    main()
