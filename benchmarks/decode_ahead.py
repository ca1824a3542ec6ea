"""Decode one step ahead or not: a request decoding alone, with the next step's graph built
and queued before this step's token is read (as mlx-lm's generator runs), against each
step reading its token first. Side by side in one process, alternated turn by turn, on the
same agent (hot turns of ~10 new tokens, then 48 tokens decoded greedily).

    .venv/bin/python benchmarks/decode_ahead.py                       # CPU: both shipped models
    python3 benchmarks/decode_ahead.py --models llama-3.1-8b,qwen3-8b --contexts 4096,32768  # GPU

A name of ``random_model.SCALE_CONFIGS`` is built with RANDOM WEIGHTS (bf16; timings only).
Writes results/decode_ahead_<device>.json and .png; prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))

MODES = ("step by step", "one ahead")
DECODE_TOKENS = 48


def measure(model: str, ctx: int, kv_bits: int | None, turns: int, root: Path) -> dict[str, Any]:
    from gpu import prompt_text

    from langchain_agent_memory.engine.engine import Engine, GenerationParams

    engine = Engine(model, cache_dir=root / f"{Path(model).name}-{kv_bits}", kv_bits=kv_bits,
                    context_length=ctx + 2 * turns * (DECODE_TOKENS + 32) + 256)  # fmt: skip
    text = prompt_text(engine.tokenizer, ctx)
    r = engine.generate("a", text, GenerationParams(max_tokens=4, stop=[]))
    rates: dict[str, list[float]] = {m: [] for m in MODES}
    for turn in range(turns):
        for mode in MODES:
            engine._steps.decode_ahead = mode == "one ahead"
            text = text + r.text + f" Question {turn}: and then?"
            r = engine.generate("a", text, GenerationParams(max_tokens=DECODE_TOKENS, stop=[]))
            rates[mode].append((r.completion_tokens - 1) / r.timings.decode_s)
            now = time.strftime("%H:%M:%S")
            print(f"  [{now}] turn {turn + 1}/{turns} {mode}: {rates[mode][-1]:.1f} tok/s", flush=True)
    engine.close()
    return {"context": ctx, "kv": "4-bit" if kv_bits == 4 else "16-bit",
            **{m: {"median": statistics.median(v), "runs": v} for m, v in rates.items()}}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--contexts", default="1024,8192")
    ap.add_argument("--turns", type=int, default=6)
    args = ap.parse_args()
    from langchain_agent_memory.engine import load_model
    from langchain_agent_memory.engine.ops.runtime import mx  # the CPU's BLAS picked before mlx loads
    from langchain_agent_memory.testing.random_model import SCALE_CONFIGS, write_random_model

    device = "gpu" if mx.default_device() == mx.gpu else "cpu"
    root = Path(tempfile.mkdtemp(prefix="decode-ahead-"))
    out: dict[str, Any] = {"device": mx.device_info().get("device_name", device), "rows": []}
    path = RESULTS / f"decode_ahead_{device}.json"
    for name in args.models.split(","):
        model, weights = name, "real"
        if name in SCALE_CONFIGS:
            tok_dir = load_model("smollm2-135m").path
            model = str(write_random_model(SCALE_CONFIGS[name], root / name, tok_dir, dtype="bfloat16"))
            weights = "RANDOM (bf16)"
        for ctx in (int(c) for c in args.contexts.split(",")):
            for kv_bits in (4, None):
                print(f"{name} at {ctx} tokens, {'4-bit' if kv_bits else '16-bit'} KV", flush=True)
                row = measure(model, ctx, kv_bits, args.turns, root)
                out["rows"].append({"model": name, "weights": weights, **row})
                path.write_text(json.dumps(out, indent=1))
    table(out)
    plot(out, path.with_suffix(".png"))


def table(out: dict[str, Any]) -> None:
    print(f"\n{out['device']}: decode tok/s, median of the turns (alternated in one process)")
    head = f"{'model':<16}{'weights':<15}{'context':>8}{'KV':>8}"
    print(head + f"{'step by step':>14}{'one ahead':>11}{'ratio':>8}")
    for r in out["rows"]:
        a, b = r["step by step"]["median"], r["one ahead"]["median"]
        row = f"{r['model']:<16}{r['weights']:<15}{r['context']:>8}{r['kv']:>8}"
        print(row + f"{a:>14.1f}{b:>11.1f}{b / a:>8.2f}")


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = out["rows"]
    labels = [f"{r['model']}\n{r['context']} {r['kv']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(rows)), 4))
    xs = range(len(rows))
    for i, mode in enumerate(MODES):
        ax.bar([x + 0.4 * i for x in xs], [r[mode]["median"] for r in rows], 0.4, label=mode)
    ax.set_xticks([x + 0.2 for x in xs], labels, fontsize=7)
    ax.set_ylabel("decode tokens/s (median)")
    ax.set_title(f"{out['device']}: decode alone, one step ahead or not")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
