"""Hybrid models (recurrent layers among attention layers): warm vs cold vs mlx-lm's own
prompt cache, the disk an agent takes, and what the snapshot policy costs.

RANDOM WEIGHTS: the models are built from a config (``random_model``) with random weights
and SmolLM2's tokenizer: every number here is a timing or a size, never a quality figure.

- ``qwen3-next-small`` (this CPU, float32): Qwen3-Next's layer kinds (Gated DeltaNet, one
  attention layer in four, MoE) at hidden 512, 8 layers;
- ``qwen3-next-80b-a3b-e64`` (the H200, bfloat16): Qwen3-Next-80B-A3B's published shape
  with 64 of its 512 experts (10 active per token either way; all 512 are 160 GB, more
  than the H200 holds; 64 leave its 64 GB disk room for the caches).

Per context (tokens of the agent's stored text), time to first token:

- ours, cold: the context from nothing (the engine's prefill, block-boundary snapshots
  taken as it goes);
- ours, warm: a fork of the stored agent (its blocks shared), nothing in memory (its
  blocks read from disk, page cache), for EXACT (the same text again), EXTEND (a new
  question after it) and DIVERGE (the text cut 1,024 tokens before its end, then a new
  question);
- mlx-lm: ``save_prompt_cache`` after its cold prefill; EXTEND loads the file and runs
  the question; EXACT and DIVERGE re-prefill the whole prompt (``ArraysCache`` cannot be
  trimmed: mlx-lm's ``trim_prompt_cache`` refuses every hybrid model).

Disk per agent: our K/V blocks, our state snapshots (how many the policy kept), mlx-lm's
file. The policy's cost curve: for each policy (every block end, ``dense`` 8/4/2/1 unbounded,
bounded to 2x, 1x (the engine's default) or 0.5x the K/V's bytes, only the end of the turn),
bytes of snapshots against the tokens a DIVERGE at a uniformly random point re-prefills
(mean and 90th percentile), from the measured size of one snapshot.

    .venv/bin/python benchmarks/hybrid.py run --model qwen3-next-small --contexts 1024,2048,4096,8192
    python3 benchmarks/hybrid.py run --model qwen3-next-80b-a3b-e64 \
        --contexts 4096,8192,16384,32768 --out $OUT                  # on the H200
    .venv/bin/python benchmarks/hybrid.py plot [results/hybrid-*.json]

Writes ``hybrid-<model>.json`` and ``.png`` (into ``--out``, default ``results/``) and
prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # peers.py, run as a script
from peers import MlxLm, extension

RESULTS = Path(__file__).resolve().parent / "results"
BACK = 1024  # a DIVERGE this many tokens before the end of the stored text
#: name -> (``dense``: None keeps every block end; 0 only the end; ``budget``: snapshot bytes
#: at most this many times the K/V's, None unbounded). The engine's is "default".
POLICIES: dict[str, tuple[int | None, float | None]] = {
    "every block": (None, None),
    "dense 8": (8, None),
    "dense 4": (4, None),
    "dense 2": (2, None),
    "dense 1": (1, None),
    "<= 2x K/V": (4, 2.0),
    "default": (4, 1.0),
    "<= 0.5x K/V": (4, 0.5),
    "end only": (0, None),
}


def _text(tokenizer: Any, n: int) -> str:
    from langchain_agent_memory import corpus

    ids = tokenizer.encode(corpus.python_docs(), add_special_tokens=False)
    return tokenizer.decode((ids * (1 + n // len(ids)))[:n])


def policy_curve(
    n: int, prompt_end: int, snapshot_bytes: int, kv_bytes: int, points: int = 400
) -> list[dict[str, Any]]:
    """Each policy's snapshots (count, bytes, bytes over the K/V's) and the tokens a DIVERGE at
    a uniformly random point re-prefills (mean, 90th percentile)."""
    import numpy as np

    from langchain_agent_memory.engine.caches.states import BLOCK_TOKENS, FLOOR, keep

    candidates = set(range(BLOCK_TOKENS, n + 1, BLOCK_TOKENS)) | {n - 1, prompt_end}
    rng = np.random.default_rng(0)  # a benchmark's sample, nothing persisted
    at = rng.integers(1, n, size=points)
    out = []
    for name, (dense, budget) in POLICIES.items():
        if dense is None:
            kept = sorted(candidates)
        elif dense == 0:
            kept = [max(candidates)]
        else:
            limit = None if budget is None else max(FLOOR, int(budget * kv_bytes // snapshot_bytes))
            kept = keep(candidates, n, dense, also=[prompt_end], limit=limit)
        resume = np.array([max((p for p in kept if p <= t), default=0) for t in at])
        rerun = at - resume
        out.append({
            "policy": name, "snapshots": len(kept), "bytes": len(kept) * snapshot_bytes,
            "over_kv": (len(kept) * snapshot_bytes) / kv_bytes,
            "rerun_mean": float(rerun.mean()), "rerun_p90": float(np.percentile(rerun, 90)),
        })  # fmt: skip
    return out


def run(args: argparse.Namespace) -> None:
    from langchain_agent_memory.engine import load_model
    from langchain_agent_memory.engine.engine import Engine, GenerationParams
    from langchain_agent_memory.engine.ops import device
    from langchain_agent_memory.testing.random_model import SCALE_CONFIGS, write_random_model

    contexts = [int(c) for c in args.contexts.split(",")]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="hybrid-"))
    dtype = "bfloat16" if device.on_gpu() else "float32"
    t0 = time.perf_counter()
    print(f"building {args.model} with random {dtype} weights ...", flush=True)
    model_dir = write_random_model(
        SCALE_CONFIGS[args.model], root / args.model, load_model("smollm2-135m").path, dtype=dtype
    )
    print(f"  built in {time.perf_counter() - t0:.0f} s", flush=True)
    one, reply = GenerationParams(max_tokens=1), GenerationParams(max_tokens=4)
    engine = Engine(model_dir, cache_dir=root / "ours", kv_bits=4, context_length=max(contexts) + 4096)
    (root / "mlx").mkdir()
    peer = MlxLm(model_dir, None, root / "mlx", loaded=(engine.lm.model, engine.lm.tokenizer))
    engine.generate("warm-up", _text(engine.tokenizer, 600), one)  # kernels compiled first
    peer.cold(_text(engine.tokenizer, 600))
    rows: list[dict[str, Any]] = []
    data = {
        "model": args.model, "weights": f"random {dtype}", "device": "gpu" if device.on_gpu() else "cpu",
        "kv_format": engine.quant.label, "back": BACK, "rows": rows,
    }  # fmt: skip
    path = out_dir / f"hybrid-{args.model}.json"
    for n in contexts:
        print(f"{n} tokens: ours ...", flush=True)
        text = _text(engine.tokenizer, n)
        base = f"base{n}"
        cold = engine.generate(base, text, reply)  # a reply of a few tokens, as a turn has
        engine.flush()
        record = engine.admin.agent_record(base)
        assert record is not None
        stored = engine.admin.cached_text(base)
        state = engine.agents.lookup(base)[0]
        assert state is not None
        cut = stored[: state.tokens.ends[len(state.tokens) - BACK - 1]]
        prompts = {"exact": stored, "extend": stored + extension(0), "diverge": cut + extension(1)}
        ours: dict[str, Any] = {"cold": cold.timings.ttft_s}
        for kind, prompt in prompts.items():
            agent = f"{kind}{n}"
            engine.admin.set_agent(agent, record)
            engine.admin.clear_memory()  # nothing in memory: read from disk
            r = engine.generate(agent, prompt, one)
            ours[kind] = r.timings.ttft_s
            ours[f"{kind}_outcome"] = f"{r.outcome} ({r.reused_tokens} reused)"
        kv_bytes = engine.admin.store.blocks.local_bytes(record.chain)
        state_bytes = engine.admin.store.blocks.local_bytes(record.blocks[len(record.chain) :])
        print(f"{n} tokens: mlx-lm ...", flush=True)
        m_cold = peer.cold(text)
        m_extend = peer._extend(text, 0, load_first=True)
        m_diverge = peer.cold(prompts["diverge"])
        mlx = {
            "cold": m_cold["ttft_s"], "exact": m_cold["ttft_s"], "extend": m_extend["ttft_s"],
            "diverge": m_diverge["ttft_s"], "disk_bytes": m_cold["disk_bytes"],
        }  # fmt: skip
        one_snapshot = state_bytes // max(1, len(record.states))
        rows.append({
            "tokens": len(state.tokens), "ours": ours, "mlx_lm": mlx,
            "kv_bytes": kv_bytes, "state_bytes": state_bytes, "snapshots": len(record.states),
            "snapshot_positions": record.states, "snapshot_bytes": one_snapshot,
            "policy": policy_curve(len(state.tokens), cold.prompt_tokens, one_snapshot, kv_bytes),
        })  # fmt: skip
        # Written after every context: a run cut short by a time limit keeps what it measured.
        path.write_text(json.dumps({**data, "rows": sorted(rows, key=lambda r: r["tokens"])}, indent=1))
        print(
            f"{n} tokens done ({time.perf_counter() - t0:.0f} s): {json.dumps(rows[-1]['ours'])}", flush=True
        )
    engine.close()
    data["rows"] = sorted(rows, key=lambda r: r["tokens"])
    print(f"wrote {path}")
    report(data, path.with_suffix(".png"))


def report(data: dict[str, Any], png: Path) -> None:
    print(f"\n{data['model']} ({data['weights']} weights, {data['device']}, {data['kv_format']})")
    print(
        "tokens | ours cold | EXACT | EXTEND | DIVERGE-1K | mlx-lm EXTEND | mlx-lm DIVERGE | "
        "DIVERGE x | K/V MB | states MB (n) | disk / K/V"
    )
    for r in data["rows"]:
        o, m = r["ours"], r["mlx_lm"]
        total = (r["kv_bytes"] + r["state_bytes"]) / r["kv_bytes"]
        print(
            f"{r['tokens']:6d} | {o['cold']:8.3f}s | {o['exact']:.3f}s | {o['extend']:.3f}s | "
            f"{o['diverge']:.3f}s | {m['extend']:.3f}s | {m['diverge']:.3f}s | "
            f"{m['diverge'] / o['diverge']:5.1f}x | {r['kv_bytes'] / 1e6:7.1f} | "
            f"{r['state_bytes'] / 1e6:7.1f} ({r['snapshots']}) | {total:.2f}x"
        )
    last = data["rows"][-1]
    print(f"\npolicy at {last['tokens']} tokens (one snapshot {last['snapshot_bytes'] / 1e6:.1f} MB):")
    print("policy | snapshots | MB | over K/V | re-prefill mean | p90")
    for p in last["policy"]:
        print(
            f"{p['policy']:12s} | {p['snapshots']:3d} | {p['bytes'] / 1e6:8.1f} | {p['over_kv']:5.2f}x | "
            f"{p['rerun_mean']:7.0f} | {p['rerun_p90']:7.0f}"
        )
    _plot(data, png)


def _plot(data: dict[str, Any], png: Path) -> None:
    try:
        import matplotlib
    except ImportError:  # the GPU machine has none: ``plot`` draws it here from the JSON
        print("matplotlib not installed: no plot (run `plot` on the JSON)")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    tokens = [r["tokens"] for r in data["rows"]]
    for who, key, style in (("ours", "cold", "k-"), ("ours", "diverge", "C0-o"), ("ours", "extend", "C0--"),
                            ("mlx_lm", "diverge", "C1-o"), ("mlx_lm", "extend", "C1--")):  # fmt: skip
        a.plot(tokens, [r[who][key] for r in data["rows"]], style, label=f"{who} {key}")
    a.set(xscale="log", yscale="log", xlabel="agent tokens", ylabel="time to first token (s)")
    a.set_title(f"{data['model']} ({data['weights']}): warm vs cold")
    a.legend(fontsize=8)
    last = data["rows"][-1]
    for p in last["policy"]:
        b.scatter(p["bytes"] / 1e6, p["rerun_mean"], label=f"{p['policy']} ({p['snapshots']})")
    b.set(xlabel="snapshot MB per agent", ylabel="tokens re-prefilled after a random DIVERGE (mean)")
    b.set_title(f"snapshot policies at {last['tokens']} tokens")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("--model", default="qwen3-next-small")
    r.add_argument("--contexts", default="1024,2048,4096,8192")
    r.add_argument("--out", default=str(RESULTS))
    p = sub.add_parser("plot")
    p.add_argument("json", nargs="?", default=str(RESULTS / "hybrid-qwen3-next-small.json"))
    args = parser.parse_args()
    if args.command == "run":
        run(args)
    else:
        path = Path(args.json)
        report(json.loads(path.read_text()), path.with_suffix(".png"))


if __name__ == "__main__":
    import langchain_agent_memory  # noqa: F401  (before mlx: the package sets up its runtime)

    main()
