"""Time to first token: cold (full prefill) / warm (cache read from disk by a fresh
process) / hot (cache in memory), at 1K-8K tokens of real text, both shipped models,
Q4 and FP16 KV; disk bytes per token and the Q4/FP16 ratio.

    .venv/bin/python benchmarks/ttft.py                  # 1K 2K 4K 8K, both models (~30 min)
    .venv/bin/python benchmarks/ttft.py --lengths 1024 2048 --models smollm2-135m

Prompt: the first N tokens of the Python reference manual (CPython's pydoc_data), as plain
text. Cold: a request on an empty cache directory. Warm: the same prompt again from a new
process (a new Engine: every block read from disk; the engine re-runs the last token for
its logits). Hot: the same prompt again in the process that holds the cache. Cold prefill
runs at full precision for every KV format, so cold samples are pooled over the formats.
Every figure is a median of 3 runs. Writes benchmarks/results/ttft.json and ttft.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
MODES = {"q4": 4, "fp16": None}


def prompt_text(model: str, n_tokens: int) -> str:
    from langchain_agent_memory import corpus, load_model

    tok = load_model(model).tokenizer
    ids = tok.encode(corpus.python_docs(), add_special_tokens=False)[:n_tokens]
    return tok.decode(ids)


def one_request(model: str, cache_dir: str, kv_bits: int | None, prompt: str) -> dict[str, Any]:
    from langchain_agent_memory.engine.engine import Engine, GenerationParams

    eng = Engine(model, cache_dir=cache_dir, kv_bits=kv_bits)
    r = eng.generate("bench", prompt, GenerationParams(max_tokens=1))
    return {"ttft_s": r.timings.ttft_s, "load_s": r.timings.load_s, "outcome": str(r.outcome)}


def warm_in_new_process(model: str, cache_dir: str, kv_bits: int | None, prompt: str) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(prompt)
    cmd = [sys.executable, __file__, "--worker", model, cache_dir, str(kv_bits), f.name]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    Path(f.name).unlink()
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(model: str, n: int, progress: Any) -> list[dict[str, Any]]:
    from langchain_agent_memory.engine.engine import Engine, GenerationParams

    prompt = prompt_text(model, n)
    rows, cold = [], []
    for mode, bits in MODES.items():
        with tempfile.TemporaryDirectory() as tmp:
            eng = Engine(model, cache_dir=tmp, kv_bits=bits)
            one = GenerationParams(max_tokens=1)
            r = eng.generate("bench", prompt, one)
            assert str(r.outcome) == "cold", r.outcome
            cold.append(r.timings.ttft_s)
            progress()
            hot = []
            for _ in range(3):
                h = eng.generate("bench", prompt, one)
                assert h.outcome.source.value == "hot", h.outcome
                hot.append(h.timings.ttft_s)
            progress()
            files = list(Path(tmp).rglob("blocks/*/*.safetensors"))
            disk = sum(f.stat().st_size for f in files)
            warm = []
            for _ in range(3):
                w = warm_in_new_process(model, tmp, bits, prompt)
                assert w["outcome"].startswith("warm"), w
                warm.append(w)
            progress()
            rows.append(
                {
                    "model": model,
                    "tokens": r.prompt_tokens,
                    "kv": mode,
                    "hot_s": statistics.median(hot),
                    "warm_s": statistics.median(w["ttft_s"] for w in warm),
                    "warm_load_s": statistics.median(w["load_s"] for w in warm),
                    "disk_bytes": disk,
                    "bytes_per_token": disk / r.prompt_tokens,
                    "block_files": len(files),
                }
            )
            del eng
    # A third cold sample, then the pooled median for every row of this length.
    with tempfile.TemporaryDirectory() as tmp:
        cold.append(one_request(model, tmp, None, prompt)["ttft_s"])
    progress()
    for row in rows:
        row["cold_s"] = statistics.median(cold)
        row["cold_over_warm"] = row["cold_s"] / row["warm_s"]
        row["cold_over_hot"] = row["cold_s"] / row["hot_s"]
        row["hot_over_warm"] = row["hot_s"] / row["warm_s"]
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        for kv, style in (("q4", "-"), ("fp16", "--")):
            sel = sorted(
                (r for r in rows if r["model"] == model and r["kv"] == kv), key=lambda r: r["tokens"]
            )
            xs = [r["tokens"] for r in sel]
            for key, color in (("cold_s", "C3"), ("warm_s", "C0"), ("hot_s", "C2")):
                if kv == "fp16" and key == "cold_s":
                    continue
                ax.plot(xs, [r[key] for r in sel], style, color=color, marker="o", label=f"{key[:-2]} {kv}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("time to first token (s)")
        ax.set_title(model)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    ap.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048, 4096, 8192])
    a = ap.parse_args()
    if a.worker:
        model, cache_dir, bits, prompt_file = a.worker
        kv_bits = None if bits == "None" else int(bits)
        print(json.dumps(one_request(model, cache_dir, kv_bits, Path(prompt_file).read_text())))
        return

    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    console = Console()
    rows: list[dict] = []
    with Progress(console=console) as progress:
        steps = len(a.models) * len(a.lengths) * (3 * len(MODES) + 1)
        task = progress.add_task("ttft", total=steps)
        for model in a.models:
            for n in a.lengths:
                progress.update(task, description=f"{model} {n} tokens")
                rows += measure(model, n, lambda: progress.advance(task))

    table = Table(title="time to first token (median of 3), seconds")
    cols = [
        "model",
        "tokens",
        "KV",
        "cold",
        "warm",
        "hot",
        "cold/warm",
        "cold/hot",
        "hot/warm",
        "bytes/token",
    ]
    for c in cols:
        table.add_column(c, justify="right")
    for r in rows:
        table.add_row(
            r["model"], str(r["tokens"]), r["kv"], f"{r['cold_s']:.2f}", f"{r['warm_s']:.3f}",
            f"{r['hot_s']:.3f}", f"{r['cold_over_warm']:.0f}x", f"{r['cold_over_hot']:.0f}x",
            f"{r['hot_over_warm']:.2f}", f"{r['bytes_per_token']:.0f}",
        )  # fmt: skip
    console.print(table)
    ratios = {}
    for rq in (r for r in rows if r["kv"] == "q4"):
        rf = next(
            r for r in rows if r["kv"] == "fp16" and (r["model"], r["tokens"]) == (rq["model"], rq["tokens"])
        )
        ratios[f"{rq['model']}/{rq['tokens']}"] = rq["disk_bytes"] / rf["disk_bytes"]
    console.print({"q4_over_fp16_bytes": {k: round(v, 3) for k, v in ratios.items()}})
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "ttft.json").write_text(json.dumps({"rows": rows, "q4_over_fp16_bytes": ratios}, indent=2))
    plot(rows, RESULTS / "ttft.png")
    console.print(f"wrote {RESULTS / 'ttft.json'} and ttft.png")


if __name__ == "__main__":
    main()
