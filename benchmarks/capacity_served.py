"""Served capacity on a GPU: the most agents of one context length that decode together,
all resident, within a fixed memory budget beside the weights, ours against mlx-lm.

RANDOM WEIGHTS: a Llama-3.1-8B shape with random bf16 weights (SmolLM2's tokenizer): the
numbers are sizes and times, never quality (``pytest -m gpu`` checks quality).

    python3 benchmarks/capacity.py served --out DIR [--budget-gb 24] [--context 8192]
    .venv/bin/python benchmarks/capacity.py served-plot [benchmarks/results/capacity_served.json]

Per system (ours with the default format and with plain ``q4``, both serving from the
stored form; mlx-lm's bf16 ``BatchGenerator``):

- ``n`` agents of ``--context`` tokens each (distinct from their first token: no block is
  shared), all resident, decode ``DECODE`` tokens together;
- the memory they cost is mlx's active memory, measured: ours the peak of a whole turn of
  all ``n`` (each agent's new tokens prefilled over its stored form, the joins, the batched
  decode, the leaves and commits) minus the memory before the first agent existed; mlx-lm
  the peak over its decode steps only (its 8K prefills, run by the generator itself, are
  left out: the comparison is the kinder to mlx-lm). Ours over the same span (the steps
  in which all ``n`` decode, another turn) is reported beside it, ``full_batch_peak``;
- ``n`` is found by measurement: two small batches give the bytes per agent, the budget
  divided by them gives a first guess, and batches around it are run until the largest
  that stays within the budget is found;
- aggregate decode tokens/s at that batch: ``n`` over the median step in which all ``n``
  decoded (the mean over those steps beside it: it holds the joins' and leaves' copies).

Writes DIR/capacity_served.json; ``served-plot`` prints the table and writes
benchmarks/results/capacity_served.png.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu import device_name, log, prompt_text, random_model_dir
from peers import extension

RESULTS = Path(__file__).resolve().parent / "results"
DECODE = 32
#: Ours: the default format (``kv_bits=4``) and plain 4-bit, the reference system's format.
FORMATS = {"default": 4, "q4": "q4"}


def _settled() -> int:
    """mlx's active memory once everything queued has run and freed buffers are given back."""
    import mlx.core as mx

    gc.collect()
    mx.synchronize()
    mx.clear_cache()
    return mx.get_active_memory()


class OursAgents:
    """Agents of one engine, built one by one (each a cold turn), all kept resident."""

    def __init__(self, model_dir: Path, root: Path, kv: int | str, texts: Callable[[int], str], ctx: int):
        from langchain_agent_memory.engine.engine import Engine

        self.base = _settled()
        self.engine = Engine(
            model_dir, cache_dir=root, kv_format=kv, attention="stored", hot_agents=1 << 20,
            share_prefixes=False, context_length=4 * ctx,
        )  # fmt: skip
        self.texts = texts
        self.n = 0
        self.turns = 0

    def resize(self, n: int) -> None:
        from langchain_agent_memory.engine.engine import GenerationParams

        while self.n < n:
            r = self.engine.generate(f"a{self.n}", self.texts(self.n), GenerationParams(max_tokens=1))
            if self.n % 8 == 0:
                log(f"  ours: agent {self.n} {r.outcome} ttft {r.timings.ttft_s:.2f}s")
            self.n += 1
        while self.n > n:
            self.n -= 1
            self.engine.admin.delete(f"a{self.n}")
        self.engine.flush()  # the saves' host copies are not part of what serving costs

    def _together(self, max_tokens: int) -> None:
        from langchain_agent_memory.engine.engine import GenerationParams
        from langchain_agent_memory.testing.model_matrix import run_together

        self.turns += 1
        texts = [self.engine.admin.cached_text(f"a{i}") + extension(self.turns) for i in range(self.n)]
        prompts = {f"a{i}": text for i, text in enumerate(texts)}
        run_together(self.engine, prompts, GenerationParams(max_tokens=max_tokens))

    def round(self, n: int) -> dict[str, Any]:
        import mlx.core as mx

        self.resize(n)
        self._together(4)  # this batch size's shapes compiled before the clock
        self.engine.flush()
        resident = _settled() - self.base
        mx.reset_peak_memory()
        before = self.engine.stats()["decode_steps"]
        t0 = time.perf_counter()
        self._together(DECODE)
        wall = time.perf_counter() - t0
        peak = mx.get_peak_memory() - self.base
        full_peak = self._full_batch_peak(n)
        after = self.engine.stats()["decode_steps"]
        steps, seconds = (after.get(n, [0, 0.0])[j] - before.get(n, [0, 0.0])[j] for j in (0, 1))
        median = self.engine.stats()["decode_step_median_s"].get(n, 0.0)
        # every batch size the turn went through: [steps, seconds] (joins, leaves, the full batch)
        sizes = {b: [s[0] - before.get(b, [0, 0.0])[0], round(s[1] - before.get(b, [0, 0.0])[1], 3)]
                 for b, s in after.items() if s[0] != before.get(b, [0, 0.0])[0]}  # fmt: skip
        # tok/s from the median full-batch step (a join's or leave's copy, or the turn's
        # commits, fall in a few steps: the mean is reported beside it)
        return {"n": n, "resident_bytes": resident, "peak_bytes": peak, "full_batch_peak_bytes": full_peak,
                "full_steps": steps, "tok_s": n / median if median else 0.0, "step_median_s": median,
                "tok_s_mean": n * steps / seconds if seconds else 0.0, "turn_wall_s": wall,
                "steps_by_batch": sizes}  # fmt: skip

    def _full_batch_peak(self, n: int) -> int:
        """Peak active memory over the steps in which all ``n`` decode (one more turn): what
        mlx-lm's figure covers (its decode steps only). A thread watches the batch: the
        peak is reset once all ``n`` are in it and read while they still are."""
        import mlx.core as mx

        runner = self.engine._steps.runner
        seen, done = [0], threading.Event()

        def watch() -> None:
            full = False
            while not done.is_set():
                if len(runner._members) == n:
                    if not full:
                        mx.reset_peak_memory()
                        full = True
                    seen[0] = max(seen[0], mx.get_peak_memory())
                elif full:
                    return
                time.sleep(0.0005)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            self._together(DECODE)
        finally:
            done.set()
            watcher.join()
        return seen[0] - self.base

    def close(self) -> None:
        self.engine.close()


class MlxLmAgents:
    """mlx-lm's ``BatchGenerator`` over ``n`` prompts: its own prefill, then decode."""

    def __init__(self, model: Any, tokenizer: Any, texts: Callable[[int], str]):
        self.model, self.tokenizer, self.texts = model, tokenizer, texts

    def round(self, n: int) -> dict[str, Any]:
        import mlx.core as mx
        from mlx_lm.generate import BatchGenerator

        base = _settled()
        gen = BatchGenerator(
            self.model, max_tokens=DECODE, stop_tokens=[], completion_batch_size=n,
            prefill_batch_size=min(n, 4),
        )  # fmt: skip
        gen.insert([self.tokenizer.encode(self.texts(i)) for i in range(n)])
        full_steps, seconds, t_prev, resident, peak, took = 0, 0.0, None, 0, 0, []
        while responses := gen.next_generated():
            now = time.perf_counter()
            full = len(responses) == n and not any(r.finish_reason for r in responses)
            if full:
                if t_prev is None:  # the first step with all n decoding: the clock starts
                    resident = mx.get_active_memory() - base
                    mx.reset_peak_memory()
                else:
                    full_steps += 1
                    seconds += now - t_prev
                    took.append(now - t_prev)
                peak = mx.get_peak_memory() - base
            t_prev = now if full else t_prev
        gen.close()
        del gen
        _settled()
        median = statistics.median(took) if took else 0.0
        return {"n": n, "resident_bytes": resident, "peak_bytes": peak, "full_steps": full_steps,
                "tok_s": n / median if median else 0.0, "step_median_s": median,
                "tok_s_mean": full_steps * n / seconds if seconds else 0.0}  # fmt: skip


def most_within(
    round_: Callable[[int], dict[str, Any]],
    budget: int,
    probes: tuple[int, int],
    fixed_ns: tuple[int, ...] = (),
) -> dict[str, Any]:
    """The largest batch whose measured peak stays within ``budget``: ``probes`` give the
    bytes per agent (a line through two batches), the first guess follows, then single
    steps up (while it fits) or jumps down (by what it was over) decide."""
    rows = [round_(p) for p in probes]
    if fixed_ns:  # the batches asked for, no search
        rows += [round_(n) for n in fixed_ns]
        for r in rows:
            log(f"  {json.dumps(r)}")
        fits = [r for r in rows if r["peak_bytes"] <= budget]
        first, last = rows[0], rows[-1]
        slope = (last["peak_bytes"] - first["peak_bytes"]) / (last["n"] - first["n"])
        best = max(fits, key=lambda r: r["n"]) if fits else None
        # over the span mlx-lm's figure covers (its decode steps only)
        span = [r for r in rows if r.get("full_batch_peak_bytes", r["peak_bytes"]) <= budget]
        best_span = max(span, key=lambda r: r["n"]) if span else None
        return {"best": best, "best_decode_span": best_span, "rounds": rows, "per_agent_bytes": slope}
    for r in rows:
        log(f"  probe {json.dumps(r)}")
    (n1, p1), (n2, p2) = ((r["n"], r["peak_bytes"]) for r in rows)
    per_agent = (p2 - p1) / (n2 - n1)
    fixed = p1 - per_agent * n1
    n = max(1, int((budget - fixed) // per_agent))
    tried: dict[int, dict[str, Any]] = {r["n"]: r for r in rows}
    for _ in range(6):
        r = tried[n] if n in tried else round_(n)
        tried[n] = r
        log(f"  n={n}: peak {r['peak_bytes'] / 1e9:.2f} GB, {r['tok_s']:.0f} tok/s")
        if r["peak_bytes"] <= budget:
            if n + 1 in tried and tried[n + 1]["peak_bytes"] > budget:
                break
            n += 1
        else:
            n = max(1, n - max(1, math.ceil((r["peak_bytes"] - budget) / per_agent)))
            if n in tried and tried[n]["peak_bytes"] <= budget:
                break  # n + 1 was over
    fits = [r for r in tried.values() if r["peak_bytes"] <= budget]
    best = max(fits, key=lambda r: r["n"]) if fits else None
    return {"per_agent_bytes": per_agent, "fixed_bytes": fixed, "best": best,
            "rounds": sorted(tried.values(), key=lambda r: r["n"])}  # fmt: skip


def run(args: argparse.Namespace) -> None:

    from langchain_agent_memory.engine import load_model

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    budget = int(args.budget_gb * 1e9)
    result: dict[str, Any] = {
        "device": device_name(),
        "model": f"{args.model} shape, RANDOM weights, SmolLM2's tokenizer",
        "context": args.context, "budget_bytes": budget, "decode_tokens": DECODE, "systems": {},
    }  # fmt: skip

    def save() -> None:
        (out_dir / "capacity_served.json").write_text(json.dumps(result, indent=1))

    root = Path(tempfile.mkdtemp(prefix="capacity-"))
    model_dir = random_model_dir(args.model, root / "model")
    loaded = load_model(model_dir)
    body = prompt_text(loaded.tokenizer, args.context - 8)

    def texts(i: int) -> str:
        return f"Agent {i} reads:\n{body}"

    try:
        for system in args.systems.split(","):
            log(f"{system} ...")
            try:
                if system == "mlx-lm":
                    ns = tuple(int(x) for x in args.mlx_ns.split(",") if x)
                    found = most_within(
                        MlxLmAgents(loaded.model, loaded.tokenizer, texts).round, budget, (2, 4), ns
                    )
                else:
                    agents = OursAgents(model_dir, root / system, FORMATS[system], texts, args.context)
                    try:
                        ns = tuple(int(x) for x in args.ns.split(",") if x)
                        found = most_within(agents.round, budget, (4, 8), ns)
                    finally:
                        agents.close()
                        shutil.rmtree(root / system, ignore_errors=True)  # ~0.4 GB on disk per agent
                result["systems"][system] = found
            except Exception as exc:
                result["systems"][system] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            log(f"{system}: {json.dumps(result['systems'][system].get('best') or result['systems'][system])}")
            save()
            _settled()
    finally:  # the random model (16 GB) and the agents' blocks: a device's disk is small
        shutil.rmtree(root, ignore_errors=True)


def plot(path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from rich.console import Console
    from rich.table import Table

    data = json.loads(path.read_text())
    budget = data["budget_bytes"]
    table = Table(
        title=f"{data['device']}: agents of {data['context']} tokens decoding together within "
        f"{budget / 1e9:g} GB ({data['model']})"
    )
    cols = ("system", "GB per agent", "agents", "peak GB", "tok/s at that batch", "agents vs mlx-lm",
            "agents, decode steps only")  # fmt: skip
    for col in cols:
        table.add_column(col, justify="right")
    systems = {k: v for k, v in data["systems"].items() if v.get("best")}
    peer = systems.get("mlx-lm", {}).get("best")
    for name, s in systems.items():
        b = s["best"]
        table.add_row(
            name, f"{s['per_agent_bytes'] / 1e9:.3f}", str(b["n"]), f"{b['peak_bytes'] / 1e9:.2f}",
            f"{b['tok_s']:.0f}", f"{b['n'] / peer['n']:.2f}x" if peer else "-",
            str((s.get("best_decode_span") or {}).get("n", "-")),
        )  # fmt: skip
    Console().print(table)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    names = list(systems)
    axes[0].bar(names, [systems[k]["best"]["n"] for k in names], color="tab:green")
    axes[0].set_title(f"agents of {data['context'] // 1024}K within {budget / 1e9:g} GB")
    axes[1].bar(names, [systems[k]["best"]["tok_s"] for k in names], color="tab:blue")
    axes[1].set_title("aggregate decode tokens/s at that batch")
    fig.suptitle(f"{data['device']}, {data['model']}")
    fig.tight_layout()
    out = RESULTS / "capacity_served.png"
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("served")
    r.add_argument("--out", required=True)
    r.add_argument("--budget-gb", type=float, default=24.0)
    r.add_argument("--context", type=int, default=8192)
    r.add_argument("--systems", default="default,q4,mlx-lm")
    r.add_argument("--ns", default="", help="ours: these batch sizes after the probes, no search")
    r.add_argument("--mlx-ns", default="", help="mlx-lm: these batch sizes after the probes, no search")
    r.add_argument("--model", default="llama-3.1-8b", help="a random_model config (SCALE_ or SMALL_CONFIGS)")
    p = sub.add_parser("served-plot")
    p.add_argument("path", nargs="?", default=str(RESULTS / "capacity_served.json"))
    args = ap.parse_args()
    if args.cmd == "served":
        run(args)
    else:
        plot(Path(args.path))
