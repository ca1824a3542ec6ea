"""Routing to experts: 10 expert agents, each primed with a ~4K-token document; each query
is routed to the 2-3 experts whose documents match it best; cold vs warm vs hot.

    .venv/bin/python benchmarks/routing.py [--model smollm2-135m] [--queries 6]

Experts: ten consecutive ~4K-token parts of the Python reference manual (CPython's
pydoc_data), one per expert, each in its system prompt. Router: the experts whose
document shares the most words with the query (top 3, or top 2 when the third scores
under half the first). A query's experts answer at once (their requests are batched).

- cold: every expert call starts from an empty cache (a system without persistent KV);
- warm: the experts' caches are on disk and the process is new: each query runs in its own
  process, so every call reads its expert's cache from disk;
- hot: one process holding every expert's cache in memory (loaded before the queries).

Reported per mode: time to first token of each expert call and each query's wall time
(all its experts answered). Writes benchmarks/results/routing.json and .png.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
EXPERTS = 10
DOC_TOKENS = 4000
QUERIES = [
    "How does the with statement call __enter__ and __exit__?",
    "What does the yield expression return inside a generator?",
    "How are default parameter values of a function evaluated?",
    "What happens when a for loop's iterable is exhausted and there is an else clause?",
    "How does attribute lookup work on a class instance?",
    "What does the global statement declare inside a function?",
    "How are exceptions raised and handled with try, except and finally?",
    "What operators compare two objects, and what do they return?",
]


def documents(model: str) -> list[str]:
    from langchain_agent_memory import corpus, load_model

    tok = load_model(model).tokenizer
    ids = tok.encode(corpus.python_docs(), add_special_tokens=False)
    return [tok.decode(ids[i * DOC_TOKENS : (i + 1) * DOC_TOKENS]) for i in range(EXPERTS)]


def route(query: str, docs: list[str]) -> list[int]:
    words = set(re.findall(r"[a-z_]{3,}", query.lower()))
    scores = [sum(doc.lower().count(w) for w in words) for doc in docs]
    ranked = sorted(range(len(docs)), key=lambda i: -scores[i])
    return ranked[:3] if scores[ranked[2]] * 2 >= scores[ranked[0]] else ranked[:2]


def messages(doc: str, query: str) -> list[Any]:
    from langchain_core.messages import HumanMessage, SystemMessage

    system = "You are an expert on this part of the Python reference. Answer briefly.\n\n" + doc
    return [SystemMessage(system), HumanMessage(query)]


def ask(llm: Any, docs: list[str], query: str, experts: list[int]) -> dict[str, Any]:
    """The query to its experts at once; each expert's time to first token and cache."""
    calls: dict[int, dict] = {}

    def one(i: int) -> None:
        reply = llm.invoke(messages(docs[i], query), agent_id=f"expert-{i}")
        meta = reply.response_metadata
        calls[i] = {"expert": i, "ttft_s": meta["time_to_first_token_s"], "cache": meta["cache"]}

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in experts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {
        "query": query,
        "experts": experts,
        "wall_s": time.perf_counter() - t0,
        "calls": list(calls.values()),
    }


def worker(model: str, cache_dir: str, mode: str, queries: list[str], max_tokens: int) -> list[dict]:
    from langchain_agent_memory import ChatAgentMemory

    docs = documents(model)
    llm = ChatAgentMemory(model=model, cache_dir=cache_dir, max_tokens=max_tokens, hot_budget_mb=1024)
    engine = llm.engine
    if mode == "prime":
        for i in range(EXPERTS):
            engine.admin.delete(f"expert-{i}")
            llm.invoke(messages(docs[i], "Which topics does your part cover?"), agent_id=f"expert-{i}")
        return []
    if mode == "hot":
        engine.admin.prefetch([f"expert-{i}" for i in range(EXPERTS)]).result()
    out = []
    for q in queries:
        experts = route(q, docs)
        if mode == "cold":
            for i in experts:
                engine.admin.delete(f"expert-{i}")
        out.append(ask(llm, docs, q, experts))
    return out


def run(a: argparse.Namespace, cache_dir: str, mode: str, queries: list[str]) -> list[dict]:
    cmd = [sys.executable, __file__, "--worker", a.model, cache_dir, mode, str(a.max_tokens), *queries]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def plot(results: dict[str, list[dict]], model: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    modes = list(results)
    ax.boxplot([[c["ttft_s"] for r in results[m] for c in r["calls"]] for m in modes], tick_labels=modes)
    ax.set_yscale("log")
    ax.set_ylabel("expert time to first token (s)")
    ax.set_title(f"routing to {EXPERTS} experts with ~{DOC_TOKENS}-token documents ({model})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--queries", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=16)
    a = ap.parse_args()
    if a.worker:
        model, cache_dir, mode, max_tokens, *queries = a.worker
        print(json.dumps(worker(model, cache_dir, mode, queries, int(max_tokens))))
        return

    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    console = Console(width=max(Console().width, 110))
    queries = QUERIES[: a.queries]
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp, Progress(console=console) as progress:
        task = progress.add_task("routing", total=3 + len(queries))
        progress.update(task, description="cold: every call on an empty cache")
        results["cold"] = run(a, tmp + "/cold", "cold", queries)
        progress.advance(task)
        progress.update(task, description=f"priming {EXPERTS} experts")
        run(a, tmp + "/kept", "prime", [])
        progress.advance(task)
        results["warm"] = []
        for q in queries:  # each query in a new process: every expert read from disk
            progress.update(task, description=f"warm: {q[:40]}")
            results["warm"] += run(a, tmp + "/kept", "warm", [q])
            progress.advance(task)
        progress.update(task, description="hot: every expert in memory")
        results["hot"] = run(a, tmp + "/kept", "hot", queries)
        progress.advance(task)

    table = Table(title=f"routing: {EXPERTS} experts x ~{DOC_TOKENS}-token documents, {a.model}")
    for col in ("mode", "expert calls", "TTFT median", "TTFT max", "query wall (mean)", "caches",
                "vs cold (query wall)"):  # fmt: skip
        table.add_column(col, justify="right")
    summary = {}
    for mode, rs in results.items():
        ttfts = [c["ttft_s"] for r in rs for c in r["calls"]]
        caches = sorted({c["cache"] for r in rs for c in r["calls"]})
        summary[mode] = {
            "calls": len(ttfts),
            "ttft_median_s": statistics.median(ttfts),
            "ttft_max_s": max(ttfts),
            "query_wall_mean_s": statistics.mean(r["wall_s"] for r in rs),
            "caches": caches,
        }
    for mode, s in summary.items():
        table.add_row(
            mode, str(s["calls"]), f"{s['ttft_median_s']:.2f} s", f"{s['ttft_max_s']:.2f} s",
            f"{s['query_wall_mean_s']:.2f} s", ", ".join(s["caches"]),
            f"{summary['cold']['query_wall_mean_s'] / s['query_wall_mean_s']:.0f}x",
        )  # fmt: skip
    console.print(table)
    for r in results["hot"]:
        console.print(f"  {r['query'][:60]:<60} -> experts {r['experts']}")

    out = HERE / "results"
    out.mkdir(exist_ok=True)
    payload = {"model": a.model, "doc_tokens": DOC_TOKENS, "results": results, "summary": summary}
    (out / "routing.json").write_text(json.dumps(payload, indent=2))

    plot(results, a.model, out / "routing.png")
    console.print(f"wrote {out / 'routing.json'} and routing.png")


if __name__ == "__main__":
    main()
