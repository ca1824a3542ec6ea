"""A LangGraph map step: N ``Send`` tasks over a shared ~1K-token system prompt whose blocks
are stored already (each task a new agent, ``hot-shared``), against the same N calls one
after another on one agent, and against mlx-lm's own batch of N as the floor.

    .venv/bin/python benchmarks/fanout.py [--items 4 8 16] [--prefix-tokens 1024] [--repeats 2]

For each N, side by side in one process (repeats interleaved: this machine is shared, the
ratios are what counts), each from an empty cache directory whose prefix was stored by one
earlier call (another agent):

- ``sequential``: the N calls in turn on one agent (``agent_id`` given): each cuts the last
  one's cache back to the prefix (``hot-diverge``), prefills its question, decodes;
- ``fan-out``: a LangGraph map of N ``Send`` tasks (``max_concurrency`` N), each on its own
  agent (``{thread}:answer#{i}``): they start from the stored prefix (one read, the others
  fork the first's caches), prefill their questions together and decode as one batch;
- ``mlx-lm batch``: ``mlx_lm.generate.batch_generate`` on the engine's loaded model (the
  same float32 weights and BLAS), the prefix prefilled once beforehand (not timed) and
  given to each of the N prompts as its prompt cache, the N questions' tokens as prompts:
  the arithmetic floor of a fan-out (no graph, no store, no saves).

Every call generates up to ``--tokens`` tokens (greedy). The fan-out's breakdown comes from
its replies' ``response_metadata`` (means over the N requests): reading the prefix
(``load_s``), forking a sibling's caches (``fork_s``), prefill of the question tails
(``prefill_s`` less ``fork_s``), batched decode (``decode_s``), the turn made ready to
store (``save_s``, on the model's thread), and the rest of the wall (LangGraph's task
threads, scheduling, the prompts' rendering and matching).

Writes results/fanout.json and results/fanout.png.
"""

from __future__ import annotations

import argparse
import copy
import json
import operator
import statistics
import tempfile
import time
from pathlib import Path
from typing import Annotated, Any, TypedDict

from langchain_core.messages import HumanMessage, SystemMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import Send  # at module level: LangGraph reads the branch's annotations

HERE = Path(__file__).resolve().parent
SYSTEMS = ("sequential", "fan-out", "mlx-lm batch")
PHASES = ("load_s", "fork_s", "prefill_s", "decode_s", "save_s")


class State(TypedDict):
    items: list[str]
    answers: Annotated[list[dict[str, Any]], operator.add]


def _questions(n: int, round_: int) -> list[str]:
    return [f"Round {round_}, item {i}: what does section {i + 1} say?" for i in range(n)]


def build(llm: Any, prefix: str) -> Any:
    def fan_out(state: State) -> list[Send]:
        return [Send("answer", q) for q in state["items"]]

    def answer(question: str) -> dict[str, Any]:
        reply = llm.invoke([SystemMessage(prefix), HumanMessage(question)])
        meta = reply.response_metadata
        return {
            "answers": [
                {
                    "cache": meta["cache"],
                    **{k: meta[k] for k in PHASES},
                    "ttft_s": meta["time_to_first_token_s"],
                }
            ]
        }

    g = StateGraph(State)
    g.add_node("answer", answer)
    g.add_conditional_edges(START, fan_out, ["answer"])
    g.add_edge("answer", END)
    return g.compile(checkpointer=InMemorySaver())


def _llm(prefix: str, tokens: int) -> Any:
    """A chat model on an empty cache directory whose prefix blocks another agent stored."""
    from langchain_agent_memory import ChatAgentMemory

    llm = ChatAgentMemory(cache_dir=tempfile.mkdtemp(prefix="fanout-"), max_tokens=tokens)
    llm.invoke([SystemMessage(prefix), HumanMessage("Which license is this?")], agent_id="bench:first")
    llm.flush()
    return llm


def sequential(prefix: str, n: int, tokens: int) -> dict[str, Any]:
    llm = _llm(prefix, tokens)
    t0 = time.perf_counter()
    caches = [
        llm.invoke([SystemMessage(prefix), HumanMessage(q)], agent_id="bench:answer").response_metadata[
            "cache"
        ]
        for q in _questions(n, 1)
    ]
    wall = time.perf_counter() - t0
    llm.engine.close()
    return {"wall_s": wall, "caches": caches}


def fan_out(prefix: str, n: int, tokens: int) -> dict[str, Any]:
    llm = _llm(prefix, tokens)
    app = build(llm, prefix)
    # LangGraph runs a step's tasks on min(32, CPUs + 4) threads unless told: all at once here.
    config = {"configurable": {"thread_id": "bench"}, "max_concurrency": n}
    t0 = time.perf_counter()
    out = app.invoke({"items": _questions(n, 1), "answers": []}, config)
    wall = time.perf_counter() - t0
    answers = out["answers"]
    stats = llm.engine.stats()
    llm.engine.close()
    phases = {k: statistics.mean(a[k] for a in answers) for k in PHASES}
    phases["prefill_s"] -= phases["fork_s"]  # prefill_s includes the fork
    span = max(a["ttft_s"] + a["decode_s"] for a in answers)
    return {
        "wall_s": wall, "caches": [a["cache"] for a in answers], "phases": phases,
        "other_s": wall - span, "max_decode_batch": stats["max_decode_batch"],
    }  # fmt: skip


def mlx_batch(prefix: str, n: int, tokens: int) -> dict[str, Any]:
    """mlx-lm's batch of ``n``: the prefix's cache prefilled once (untimed), copied to each."""
    import mlx.core as mx
    from mlx_lm.generate import batch_generate, generate_step
    from mlx_lm.models.cache import make_prompt_cache

    from langchain_agent_memory import load_model
    from langchain_agent_memory.chat import prompt
    from langchain_agent_memory.engine.prefix import tokenize_prompt

    lm = load_model("smollm2-135m")
    prompts = [
        tokenize_prompt(
            lm.tokenizer, prompt.render(lm.tokenizer, [SystemMessage(prefix), HumanMessage(q)])
        ).ids
        for q in _questions(n, 1)
    ]
    common = 0
    while all(len(p) > common + 1 and p[common] == prompts[0][common] for p in prompts):
        common += 1
    cache = make_prompt_cache(lm.model)
    for _ in generate_step(mx.array(prompts[0][:common]), lm.model, prompt_cache=cache, max_tokens=0):
        pass  # the prefix fed, its first sample evaluated and not fed
    mx.eval([c.state for c in cache])
    caches = [copy.deepcopy(cache) for _ in range(n)]
    t0 = time.perf_counter()
    out = batch_generate(lm.model, lm.tokenizer, [p[common:] for p in prompts], caches, max_tokens=tokens)
    wall = time.perf_counter() - t0
    return {
        "wall_s": wall,
        "generation_tokens": out.stats.generation_tokens,
        "tails": len(prompts[0]) - common,
    }


RUNS = {"sequential": sequential, "fan-out": fan_out, "mlx-lm batch": mlx_batch}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--items", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--prefix-tokens", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=16, help="tokens generated per item")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=HERE / "results")
    a = ap.parse_args()

    from rich.console import Console
    from rich.table import Table

    from langchain_agent_memory import corpus, load_model

    console = Console()
    tok = load_model("smollm2-135m").tokenizer
    text = corpus.apache_license() + "\n\n" + corpus.python_docs_topic("while") * 4
    ids = tok.encode(text, add_special_tokens=False)[: a.prefix_tokens]
    prefix = "Answer from this document.\n\n" + tok.decode(ids)
    rows = []
    for n in a.items:
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SYSTEMS}
        for rep in range(a.repeats):
            for system in SYSTEMS:
                console.print(f"[dim]{n} items, repeat {rep + 1}/{a.repeats}: {system} ...[/dim]")
                run = RUNS[system](prefix, n, a.tokens)
                runs[system].append(run)
                console.print(f"[dim]  {run['wall_s']:.2f} s[/dim]")
        med = {s: statistics.median(r["wall_s"] for r in runs[s]) for s in SYSTEMS}
        fan = runs["fan-out"]
        phases = {k: statistics.median(r["phases"][k] for r in fan) for k in PHASES}
        rows.append({
            "items": n, "wall_s": med, "fan_over_sequential": med["fan-out"] / med["sequential"],
            "fan_over_mlx_batch": med["fan-out"] / med["mlx-lm batch"], "phases": phases,
            "other_s": statistics.median(r["other_s"] for r in fan), "caches": fan[-1]["caches"],
            "max_decode_batch": fan[-1]["max_decode_batch"], "runs": runs,
        })  # fmt: skip
    title = f"Sends over a stored {a.prefix_tokens}-token prefix, SmolLM2, {a.tokens} tokens each"
    table = Table(title=f"{title} (median of {a.repeats})")
    for col in (
        "N",
        "sequential",
        "fan-out",
        "mlx-lm batch",
        "fan/seq",
        "fan/mlx",
        *[p[:-2] for p in PHASES],
        "other",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        w, ph = r["wall_s"], r["phases"]
        table.add_row(
            str(r["items"]), *(f"{w[s]:.2f} s" for s in SYSTEMS), f"{r['fan_over_sequential']:.2f}×",
            f"{r['fan_over_mlx_batch']:.2f}×", *(f"{ph[p]:.3f}" for p in PHASES), f"{r['other_s']:.2f}",
        )  # fmt: skip
    console.print(table)
    a.out.mkdir(parents=True, exist_ok=True)
    payload = {"prefix_tokens": a.prefix_tokens, "tokens": a.tokens, "repeats": a.repeats, "rows": rows}
    (a.out / "fanout.json").write_text(json.dumps(payload, indent=1) + "\n")
    _plot(rows, a, a.out / "fanout.png")
    console.print(f"wrote {a.out / 'fanout.json'} and fanout.png")


def _plot(rows: list[dict[str, Any]], a: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    xs = [r["items"] for r in rows]
    for s in SYSTEMS:
        left.plot(xs, [r["wall_s"][s] for r in rows], marker="o", label=s)
    left.set_xlabel("Send tasks")
    left.set_ylabel("wall time (s)")
    left.set_title(f"{a.tokens} tokens each over a stored {a.prefix_tokens}-token prefix")
    left.legend()
    bottom = [0.0] * len(rows)
    for key in (*PHASES, "other"):
        vals = [r["other_s"] if key == "other" else r["phases"][key] for r in rows]
        right.bar([str(x) for x in xs], vals, bottom=bottom, label=key.removesuffix("_s"))
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    right.set_xlabel("Send tasks")
    right.set_ylabel("s (means over the tasks; other: the rest of the wall)")
    right.set_title("fan-out breakdown")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
