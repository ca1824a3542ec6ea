"""A LangGraph map step: 8 ``Send`` tasks whose prompts share a ~2K-token prefix (the same
system prompt and document, a different question each), two rounds on one thread.

    .venv/bin/python benchmarks/fanout.py [--items 8] [--prefix-tokens 2048] [--repeats 2]

Three ways to run it, each from an empty cache directory, side by side in one process
(repeats interleaved: this machine is shared, the ratios are what counts):

- ``one agent``: every task on the node's one agent, as before Send tasks had their own
  (``agent_id`` given): the tasks run one after another, each cutting the last one's cache
  back to the prefix;
- ``own agents``: each task on its own agent (``{thread}:{node}#{index}``), decoding
  together, but each prefilling the prefix itself (``Engine.share_prefixes = False``);
- ``own agents + shared prefix`` (the default): the first task prefills the prefix once,
  the others start from copies of its caches.

Round 1 is cold (nothing stored); round 2 asks each item a follow-up on the same thread.
Reports wall time per round and vs ``one agent``; writes results/fanout.json and .png.
"""

from __future__ import annotations

import argparse
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
SYSTEMS = ("one agent", "own agents", "own agents + shared prefix")


class State(TypedDict):
    items: list[dict[str, Any]]
    answers: Annotated[list[dict[str, Any]], operator.add]


def build(llm: Any, prefix: str, one_agent: bool) -> Any:
    def fan_out(state: State) -> list[Send]:
        return [Send("answer", item) for item in state["items"]]

    def answer(item: dict[str, Any]) -> dict[str, Any]:
        messages = [SystemMessage(prefix), *(HumanMessage(q) for q in item["questions"])]
        kwargs = {"agent_id": "bench:answer"} if one_agent else {}
        reply = llm.invoke(messages, **kwargs)
        meta = reply.response_metadata
        return {
            "answers": [
                {"agent": meta["agent_id"], "cache": meta["cache"], "ttft_s": meta["time_to_first_token_s"]}
            ]
        }

    g = StateGraph(State)
    g.add_node("answer", answer)
    g.add_conditional_edges(START, fan_out, ["answer"])
    g.add_edge("answer", END)
    return g.compile(checkpointer=InMemorySaver())


def one_run(system: str, prefix: str, items: int, tokens: int) -> dict[str, Any]:
    from langchain_agent_memory import ChatAgentMemory

    llm = ChatAgentMemory(cache_dir=tempfile.mkdtemp(prefix="fanout-"), max_tokens=tokens)
    llm.engine.share_prefixes = system == SYSTEMS[2]
    app = build(llm, prefix, one_agent=system == SYSTEMS[0])
    # LangGraph runs a step's tasks on min(32, CPUs + 4) threads unless told: all of them at once here.
    config = {"configurable": {"thread_id": "bench"}, "max_concurrency": items}
    rounds = []
    for r in range(2):
        questions = [[f"Item {i}: what does section {i + 1} say?"] for i in range(items)]
        if r:
            questions = [
                [*q, f"And in one sentence, why does section {i + 1} matter?"]
                for i, q in enumerate(questions)
            ]
        t0 = time.perf_counter()
        out = app.invoke({"items": [{"questions": q} for q in questions], "answers": []}, config)
        wall = time.perf_counter() - t0
        caches = [a["cache"] for a in out["answers"][-items:]]
        rounds.append(
            {"wall_s": wall, "caches": caches, "max_decode_batch": llm.engine.stats()["max_decode_batch"]}
        )
    llm.engine.close()
    return {"system": system, "rounds": rounds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--items", type=int, default=8)
    ap.add_argument("--prefix-tokens", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=16, help="tokens generated per item")
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()

    from rich.console import Console
    from rich.table import Table

    from langchain_agent_memory import corpus, load_model

    console = Console()
    tok = load_model("smollm2-135m").tokenizer
    text = corpus.apache_license() + "\n\n" + corpus.python_docs_topic("while") * 4
    ids = tok.encode(text, add_special_tokens=False)[: a.prefix_tokens]
    prefix = "Answer from this document.\n\n" + tok.decode(ids)
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SYSTEMS}
    for rep in range(a.repeats):
        for system in SYSTEMS:
            console.print(f"[dim]repeat {rep + 1}/{a.repeats}: {system} ...[/dim]")
            run = one_run(system, prefix, a.items, a.tokens)
            runs[system].append(run)
            walls = ", ".join(f"round {r + 1} {x['wall_s']:.1f} s" for r, x in enumerate(run["rounds"]))
            console.print(f"[dim]  {walls}[/dim]")
    summary = {
        s: {f"round{r + 1}_s": statistics.median(x["rounds"][r]["wall_s"] for x in runs[s]) for r in range(2)}
        for s in SYSTEMS
    }
    base = summary[SYSTEMS[0]]
    title = (
        f"{a.items} Send tasks over a {a.prefix_tokens}-token shared prefix, SmolLM2, {a.tokens} tokens each"
    )
    table = Table(title=f"{title} (median of {a.repeats})")
    for col in (
        "system",
        "round 1 (cold) s",
        "vs one agent",
        "round 2 (follow-up) s",
        "vs one agent",
        "round 1 caches",
    ):
        table.add_column(col, justify="right")
    for s in SYSTEMS:
        caches = runs[s][-1]["rounds"][0]["caches"]
        counts = {c: caches.count(c) for c in sorted(set(caches))}
        table.add_row(
            s, f"{summary[s]['round1_s']:.1f}", f"{base['round1_s'] / summary[s]['round1_s']:.2f}x faster",
            f"{summary[s]['round2_s']:.1f}", f"{base['round2_s'] / summary[s]['round2_s']:.2f}x faster",
            ", ".join(f"{n} {c}" for c, n in counts.items()),
        )  # fmt: skip
    console.print(table)
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    payload = {
        "items": a.items,
        "prefix_tokens": a.prefix_tokens,
        "tokens": a.tokens,
        "summary": summary,
        "runs": runs,
    }
    (out / "fanout.json").write_text(json.dumps(payload, indent=2))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.38
    xs = range(len(SYSTEMS))
    for r, off in ((0, -width / 2), (1, width / 2)):
        ax.bar(
            [x + off for x in xs],
            [summary[s][f"round{r + 1}_s"] for s in SYSTEMS],
            width,
            label=f"round {r + 1}",
        )
    ax.set_xticks(list(xs), SYSTEMS)
    ax.set_ylabel("wall time of the map step (s)")
    ax.set_title(f"{a.items} Sends over a {a.prefix_tokens}-token shared prefix (SmolLM2, CPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "fanout.png", dpi=120)
    console.print(f"wrote {out / 'fanout.json'} and fanout.png")


if __name__ == "__main__":
    main()
