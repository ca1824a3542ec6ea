"""Eviction by the graph's schedule: supervisor graphs of 12 agents under a hot tier that
holds 4 of them.

    .venv/bin/python benchmarks/graph_eviction.py [--threads 3] [--rounds 2] [--hot-agents 4]

Three LangGraph threads run at once (each on a Python thread of its own, as a server's
concurrent runs would), each a supervisor graph: the supervisor routes to its three
workers in turn; a worker answers with a tool call (decoded under the tool's schema), the
tool takes 0.2–2 s (seeded), and the worker answers again with its result; after the third
worker a human reviews (an interrupt), answered after a pause. 3 threads × (1 supervisor + 3
workers) = 12 agents, each with a system prompt of 1–4K tokens (slices of the Apache
license and the Python docs). Each round every agent speaks again, extending its own
conversation.

Policies, side by side in one run, each from an empty cache directory, under the same hot
tier (``hot_agents`` live agents, the pool's memory tier sized to about as many agents'
blocks: an agent out of both is read from disk):

- ``lru``: least recently used first (``eviction="lru"``), what the engine did before;
- ``graph``: by when each agent runs next, as the checkpointer tells it (the next step's
  agents stay, a thread waiting on its human goes first), ``tool_ttl_s=0``;
- ``graph + tool TTL``: also, an agent whose reply made tool calls stays until its result
  comes back (``tool_ttl_s=30``).

Reports per policy: share of turns whose cache was live in memory (hot), read from disk
(warm) or prefilled (cold), mean time to first token, end-to-end wall. Writes
results/graph_eviction.json and results/graph_eviction.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Annotated, Any, TypedDict

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from rich.console import Console
from rich.table import Table

HERE = Path(__file__).resolve().parent
POLICIES = {"lru": ("lru", 0.0), "graph": ("schedule", 0.0), "graph + tool TTL": ("schedule", 30.0)}
WORKERS = ("w1", "w2", "w3")


@tool
def inventory(item: int) -> int:
    """How many of an item are in stock."""
    return item * 7


def _merge(a: dict[str, list[Any]], b: dict[str, list[Any]]) -> dict[str, list[Any]]:
    return {**a, **b}


def _rows(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return a + b


class State(TypedDict):
    round: int
    step: int
    hist: Annotated[dict[str, list[Any]], _merge]
    rows: Annotated[list[dict[str, Any]], _rows]


def _system_prompts(thread: int) -> dict[str, str]:
    from langchain_agent_memory import corpus

    text = corpus.apache_license() + "\n\n" + corpus.python_docs()
    rng = random.Random(thread)
    prompts = {}
    for name in ("sup", *WORKERS):
        chars = rng.randint(4000, 15000)  # ~1-4K tokens
        start = rng.randint(0, max(0, len(text) - chars))
        role = "You route work to workers." if name == "sup" else f"You are worker {name}; use your tool."
        prompts[name] = f"{role}\n\nReference:\n{text[start : start + chars]}"
    return prompts


def _row(agent: str, message: BaseMessage) -> dict[str, Any]:
    meta = message.response_metadata
    return {"agent": agent, "cache": str(meta["cache"]), "ttft_s": float(meta["time_to_first_token_s"])}


def build(llm: Any, saver: Any, thread: int, seed: int) -> Any:
    from langgraph.graph import END, START, StateGraph
    from langgraph.types import interrupt

    prompts = _system_prompts(thread)
    rng = random.Random(seed)
    # The tools stay bound on every turn of a worker, as an agent loop binds them: the
    # system text (which lists them) is then the same turn after turn.
    tools = llm.bind_tools([inventory], tool_choice="inventory").bind(max_tokens=40)  # the whole call
    answers = llm.bind_tools([inventory])

    def sup(state: State) -> dict[str, Any]:
        hist = state["hist"].get("sup", [])
        ask = HumanMessage(f"Round {state['round']}, step {state['step']}: who is next?")
        reply = llm.invoke([SystemMessage(prompts["sup"]), *hist, ask])
        return {"step": state["step"] + 1, "hist": {"sup": [*hist, ask, reply]}, "rows": [_row("sup", reply)]}

    def worker(name: str) -> Any:
        def run(state: State) -> dict[str, Any]:
            hist = state["hist"].get(name, [])
            ask = HumanMessage(f"Round {state['round']}: check stock of item {state['step']}.")
            msgs = [SystemMessage(prompts[name]), *hist, ask]
            call = tools.invoke(msgs)
            assert isinstance(call, AIMessage) and call.tool_calls, call
            time.sleep(rng.uniform(0.2, 2.0))  # the tool runs
            first = call.tool_calls[0]
            result = ToolMessage(str(inventory.invoke(first["args"])), tool_call_id=first["id"])
            answer = answers.invoke([*msgs, call, result])
            rows = [_row(name, call), _row(name, answer)]
            return {"hist": {name: [*hist, ask, call, result, answer]}, "rows": rows}

        return run

    def review(state: State) -> dict[str, Any]:
        interrupt("approve this round?")
        return {}

    def route(state: State) -> str:  # the supervisor's turn ``step`` (from 1) set ``step + 1``
        done = state["step"] - 2  # workers run before it
        return WORKERS[done] if done < len(WORKERS) else "review"

    graph = StateGraph(State)
    graph.add_node("sup", sup)
    for name in WORKERS:
        graph.add_node(name, worker(name))
        graph.add_edge(name, "sup")
    graph.add_node("review", review)
    graph.add_edge(START, "sup")
    graph.add_conditional_edges("sup", route, [*WORKERS, "review"])
    graph.add_edge("review", END)
    return graph.compile(checkpointer=saver)


def run_policy(
    name: str, model: str, threads: int, rounds: int, hot_agents: int, hot_mb: int
) -> dict[str, Any]:
    from langgraph.types import Command

    from langchain_agent_memory import AgentMemorySaver, ChatAgentMemory
    from langchain_agent_memory.engine import shared_engine

    eviction, ttl = POLICIES[name]
    with tempfile.TemporaryDirectory(prefix="graph-eviction-") as tmp:
        llm = ChatAgentMemory(model=model, cache_dir=tmp, max_tokens=12, hot_budget_mb=hot_mb)
        config = dataclasses.replace(
            llm.engine_config(), hot_agents=hot_agents, eviction=eviction, tool_ttl_s=ttl
        )
        engine = shared_engine(config)  # the chat model and the saver find this one (same key)
        rows: list[dict[str, Any]] = []
        lock = threading.Lock()
        with AgentMemorySaver(cache_dir=tmp, model=model) as saver:

            def one_thread(t: int) -> None:
                app = build(llm, saver, t, seed=100 + t)
                cfg = {"configurable": {"thread_id": f"run-{t}"}}
                seen = 0
                for r in range(rounds):
                    start: dict[str, Any] = {"round": r, "step": 1}
                    app.invoke({**start, "hist": {}, "rows": []} if r == 0 else start, cfg)  # to the review
                    time.sleep(1.0)  # the human reads, then approves
                    out = app.invoke(Command(resume="ok"), cfg)
                    with lock:
                        rows.extend(dict(row, round=r, thread=t) for row in out["rows"][seen:])
                    seen = len(out["rows"])

            t0 = time.perf_counter()
            workers = [threading.Thread(target=one_thread, args=(t,)) for t in range(threads)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            wall = time.perf_counter() - t0
            stats = engine.stats()
        engine.close()
    later = [r for r in rows if r["round"] > 0]  # round 0 is cold by construction
    share = {
        k: sum(r["cache"].startswith(k) for r in later) / max(1, len(later)) for k in ("hot", "warm", "cold")
    }
    return {
        "policy": name, "wall_s": wall, "turns": len(rows), "later_turns": len(later), "share": share,
        "mean_ttft_s": statistics.mean(r["ttft_s"] for r in later) if later else None,
        "hot_tier": stats["hot_tier"], "rows": rows,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--hot-agents", type=int, default=4)
    ap.add_argument("--hot-mb", type=int, default=64, help="the pool's memory tier (about 4 agents' blocks)")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args()
    console = Console()
    results = []
    for name in POLICIES:
        console.print(f"[dim]policy {name}…[/dim]")
        results.append(run_policy(name, args.model, args.threads, args.rounds, args.hot_agents, args.hot_mb))
    data = {"args": {k: str(v) for k, v in vars(args).items()}, "policies": results}
    table = Table(
        title=f"{args.threads} threads × 4 agents, hot tier of {args.hot_agents} (rounds after the first)"
    )
    for c in ("policy", "hot", "warm", "cold", "mean TTFT", "wall", "vs lru"):
        table.add_column(c, justify="right")
    lru_wall = results[0]["wall_s"]
    for r in results:
        shares = [f"{r['share'][k]:.0%}" for k in ("hot", "warm", "cold")]
        timing = [f"{r['mean_ttft_s']:.3f} s", f"{r['wall_s']:.1f} s", f"{lru_wall / r['wall_s']:.2f}×"]
        table.add_row(r["policy"], *shares, *timing)
    console.print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "graph_eviction.json").write_text(json.dumps(data, indent=1) + "\n")
    _plot(results, args.out / "graph_eviction.png")
    console.print(f"wrote {args.out / 'graph_eviction.json'} and graph_eviction.png")


def _plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    names = [r["policy"] for r in results]
    bottom = [0.0] * len(results)
    for kind, color in (("hot", "tab:green"), ("warm", "tab:orange"), ("cold", "tab:red")):
        vals = [r["share"][kind] for r in results]
        a.bar(names, vals, bottom=bottom, label=kind, color=color)
        bottom = [x + v for x, v in zip(bottom, vals, strict=True)]
    a.set_title("turns by where their cache was")
    a.legend(fontsize=8)
    b.bar(names, [r["mean_ttft_s"] for r in results], color="tab:blue")
    b.set_title("mean time to first token (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
