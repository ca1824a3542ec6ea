"""Concurrent agents on one engine: batched decode throughput and staggered arrivals.

    .venv/bin/python benchmarks/concurrency.py [--model smollm2-135m] [--tokens 64]

1. System decode throughput at batch 1, 2 and 4: that many agents (warm ~400-token
   caches, a one-token prompt tail each) decode ``--tokens`` tokens at once; their steps
   run as one batched forward pass. Reported: generated tokens / second of the decode
   phase (first to last token, which includes the step or two in which the first agent
   out of its prefill decodes alone), and the steady rate while all B agents decode
   together (the scheduler's timed steps at batch B). Each batch
   size runs ``--repeats`` times, interleaved (1, 2, 4, 1, 2, 4, ...): this machine is
   shared, so ratios come from side-by-side runs.
2. Staggered arrival: agent A starts a cold prefill of a ~4K-token prompt; agent B (a warm
   cache, a short new question) arrives 2 s later. B's time to first token, counted from
   its arrival, under first-come-first-served (B waits for A's whole request) and under
   the engine's policy (shortest remaining prefill first, in chunks).

Writes benchmarks/results/concurrency.json and .png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BATCHES = (1, 2, 4)
#: (name, scheduling policy, prefill chunk tokens)
POLICIES = (
    ("fcfs", "fcfs", 512),
    ("interleave", "interleave", 512),
    ("interleave, 128-token chunks", "interleave", 128),
)


def throughput(engine: Any, prompts: list[str], batch: int, tokens: int) -> dict[str, float]:
    from langchain_agent_memory.engine.engine import GenerationParams

    results: dict[int, Any] = {}
    steps_before = engine._scheduler.steps
    engine._scheduler.decode_time.clear()

    def run(i: int) -> None:
        results[i] = engine.generate(f"agent-{i}", prompts[i], GenerationParams(max_tokens=tokens))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(batch)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    generated = sum(r.completion_tokens for r in results.values())
    decode = max(r.timings.decode_s for r in results.values())
    return {
        "tokens": generated,
        "decode_s": decode,
        "tokens_per_s": generated / decode,
        "wall_tokens_per_s": generated / wall,
        "steps": engine._scheduler.steps - steps_before,
        # while exactly `batch` agents decoded together (the first to finish its prefill
        # decodes alone for a step or two; that is left out here, kept in tokens_per_s)
        "steady_tokens_per_s": engine.stats()["decode_tokens_per_s"].get(batch, 0.0),
    }


def staggered(
    model: str, policy: str, chunk: int, cache_dir: Path, a_prompt: str, b_history: str, delay: float
) -> dict:
    from langchain_agent_memory.engine.engine import Engine, GenerationParams

    engine = Engine(model, cache_dir=cache_dir, scheduling=policy, chunk_tokens=chunk)
    engine.generate("b", b_history, GenerationParams(max_tokens=8))  # B's warm cache
    engine.admin.drop_hot()
    out: dict[str, Any] = {}

    def agent_a() -> None:
        t0 = time.perf_counter()
        for chunk in engine.stream("a", a_prompt, GenerationParams(max_tokens=8)):
            out.setdefault("a_ttft_s", time.perf_counter() - t0)
            if chunk.result:
                out["a_prompt_tokens"] = chunk.result.prompt_tokens

    thread = threading.Thread(target=agent_a)
    thread.start()
    time.sleep(delay)
    t0 = time.perf_counter()
    prompt = b_history + engine.admin.cached_text("b")[len(b_history) :] + "\nQ: And the second clause?\nA:"
    for chunk in engine.stream("b", prompt, GenerationParams(max_tokens=8)):
        out.setdefault("b_ttft_s", time.perf_counter() - t0)
        if chunk.result:
            out["b_outcome"] = str(chunk.result.outcome)
            out["b_prefill_tokens"] = chunk.result.prompt_tokens - chunk.result.reused_tokens
    thread.join()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--delay", type=float, default=2.0)
    a = ap.parse_args()

    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from langchain_agent_memory import corpus
    from langchain_agent_memory.engine.engine import Engine, GenerationParams

    console = Console(width=max(Console().width, 110))
    text = corpus.apache_license()
    prompts = [f"Agent {i}. Read this.\n\n" + text[i * 400 : i * 400 + 1500] + "\nSummary:" for i in range(4)]
    runs: dict[int, list[dict]] = {b: [] for b in BATCHES}
    stagger: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp, Progress(console=console) as progress:
        engine = Engine(a.model, cache_dir=Path(tmp) / "tput")
        task = progress.add_task(
            "batched decode", total=len(prompts) + a.repeats * len(BATCHES) + len(POLICIES)
        )
        for i, p in enumerate(prompts):  # warm caches: each run then prefills one token
            engine.generate(f"agent-{i}", p, GenerationParams(max_tokens=1))
            progress.advance(task)
        for _ in range(a.repeats):
            for b in BATCHES:
                runs[b].append(throughput(engine, prompts, b, a.tokens))
                progress.advance(task)
        a_prompt = "Read this license carefully.\n\n" + (text * 2)[:20000] + "\nQ: What is it called?\nA:"
        b_history = "You answer questions about this license.\n\n" + text[:4000] + "\nQ: Its name?\nA:"
        for name, policy, chunk in POLICIES:
            progress.update(task, description=f"staggered arrival ({name})")
            stagger[name] = staggered(a.model, policy, chunk, Path(tmp) / name, a_prompt, b_history, a.delay)
            progress.advance(task)

    summary = {
        b: {
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
            "steady_tokens_per_s": statistics.median(r["steady_tokens_per_s"] for r in rs),
            "step_ms": statistics.median(1000 * r["decode_s"] / (r["tokens"] / b) for r in rs),
        }
        for b, rs in runs.items()
    }
    base = summary[1]["tokens_per_s"]
    steady = summary[1]["steady_tokens_per_s"]
    table = Table(title=f"batched decode, {a.model}, {a.tokens} tokens per agent (median of {a.repeats})")
    cols = (
        "batch",
        "system decode tok/s",
        "vs batch 1",
        "steady tok/s (all B decoding)",
        "vs batch 1",
        "runs",
    )
    for col in cols:
        table.add_column(col, justify="right")
    for b in BATCHES:
        s = summary[b]
        table.add_row(
            str(b), f"{s['tokens_per_s']:.1f}", f"{s['tokens_per_s'] / base:.2f}x",
            f"{s['steady_tokens_per_s']:.1f}", f"{s['steady_tokens_per_s'] / steady:.2f}x",
            ", ".join(f"{r['tokens_per_s']:.1f}/{r['steady_tokens_per_s']:.1f}" for r in runs[b]),
        )  # fmt: skip
    console.print(table)
    t2 = Table(title=f"staggered arrival: B (warm) arrives {a.delay:.0f} s into A's cold prefill")
    for col in (
        "policy",
        "A prompt tokens",
        "A time to first token",
        "B prefill tokens",
        "B time to first token",
    ):
        t2.add_column(col, justify="right")
    for policy, r in stagger.items():
        t2.add_row(
            policy, str(r["a_prompt_tokens"]), f"{r['a_ttft_s']:.2f} s",
            str(r["b_prefill_tokens"]), f"{r['b_ttft_s']:.2f} s",
        )  # fmt: skip
    console.print(t2)
    for name in list(stagger)[1:]:
        ratio = stagger["fcfs"]["b_ttft_s"] / stagger[name]["b_ttft_s"]
        console.print(f"B's first token {ratio:.1f}x sooner under {name} than first-come-first-served")

    out = HERE / "results"
    out.mkdir(exist_ok=True)
    payload = {"model": a.model, "tokens": a.tokens, "runs": runs, "summary": summary, "staggered": stagger}
    (out / "concurrency.json").write_text(json.dumps(payload, indent=2))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.bar([str(b) for b in BATCHES], [summary[b]["tokens_per_s"] for b in BATCHES])
    ax1.set_xlabel("agents decoding at once")
    ax1.set_ylabel("system decode tokens / s")
    ax1.set_title(a.model)
    names = list(stagger)
    ax2.bar(names, [stagger[p]["b_ttft_s"] for p in names])
    ax2.set_ylabel("B's time to first token (s)")
    ax2.set_title(f"B arrives {a.delay:.0f} s into A's cold prefill")
    fig.tight_layout()
    fig.savefig(out / "concurrency.png", dpi=120)
    console.print(f"wrote {out / 'concurrency.json'} and concurrency.png")


if __name__ == "__main__":
    main()
