"""Eviction by the graph's schedule: a supervisor graph of 12 agents under a hot tier that
holds 4 of them; three policies side by side in one run, and mlx-lm's server-style LRU
prompt cache as the peer.

    .venv/bin/python benchmarks/graph_eviction.py [--workers 11] [--rounds 3] [--threads 1]

The graph: a supervisor routes to its workers one after another (the same plan each round);
a worker answers with a tool call (decoded under the tool's schema), the tool takes 0.2–2 s
(seeded), and the worker answers again with its result; after the last worker a human
reviews the round (an interrupt, answered after 1 s). 1 supervisor + 11 workers = 12
agents, each with a system prompt of 1–4K tokens (slices of the Apache license and the
Python docs). Each round every agent speaks again, extending its own conversation.
``--threads N`` runs N such graphs at once (on Python threads of their own, as a server's
concurrent runs would), each with its own agents.

Policies, each from an empty cache directory, under the same hot tier (``hot_agents`` live
agents, the pool's memory tier sized to about as many agents' blocks: an agent out of both
is read from disk):

- ``lru``: least recently used first (``eviction="lru"``); the checkpointer loads the next
  step's agents when it writes the step's checkpoint, as it did before;
- ``graph``: by when each agent runs next, as the checkpointer tells it: the next step's
  agents stay, and those of the step after it (the nodes seen to follow, ``StepOrder``) are
  loaded while the current step runs; a thread waiting on its human goes first;
  ``tool_ttl_s=0``;
- ``graph + tool TTL``: also, an agent whose reply made tool calls stays until its result
  comes back (``tool_ttl_s=30``);
- ``mlx-lm LRU``: mlx-lm's ``LRUPromptCache`` (``mlx_lm.server``'s, ``max_size`` = the hot
  agents) fed the same prompts as token ids (the same chat template's), in the same order,
  through ``generate_step`` on the engine's loaded model, as ``mlx_lm.server`` serves them,
  at 16-bit KV; a turn is hot
  when the cache it found covers at least half its prompt, else it prefills (mlx-lm has no
  disk tier). Its wall is its compute plus the same tool and human pauses.

Reports per policy: share of turns after the first round whose cache was live in memory
when the turn came (hot), read from disk (warm) or prefilled (cold), mean time to first
token, end-to-end wall, and the wall less the tools' and the human's pauses (``busy``;
one thread). Writes results/graph_eviction.json and results/graph_eviction.png.
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
from langchain_core.utils.function_calling import convert_to_openai_tool
from rich.console import Console
from rich.table import Table

HERE = Path(__file__).resolve().parent
POLICIES = {"lru": ("lru", 0.0), "graph": ("schedule", 0.0), "graph + tool TTL": ("schedule", 30.0)}
PEER = "mlx-lm LRU"
HUMAN_PAUSE_S = 1.0


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


def _system_prompts(thread: int, workers: list[str]) -> dict[str, str]:
    from langchain_agent_memory import corpus

    text = corpus.apache_license() + "\n\n" + corpus.python_docs()
    rng = random.Random(thread)
    prompts = {}
    for name in ("sup", *workers):
        chars = rng.randint(4000, 15000)  # ~1-4K tokens
        start = rng.randint(0, max(0, len(text) - chars))
        role = "You route work to workers." if name == "sup" else f"You are worker {name}; use your tool."
        prompts[name] = f"{role}\n\nReference:\n{text[start : start + chars]}"
    return prompts


class Recorder:
    """Every model turn's prompt (as the engine renders it) and reply length, for the peer."""

    def __init__(self, llm: Any) -> None:
        from langchain_agent_memory.chat import prompt

        self._render, self._tokenizer = prompt.render, llm.engine.tokenizer
        self.pauses_s = 0.0
        self._lock = threading.Lock()

    def row(
        self, agent: str, msgs: list[BaseMessage], tools: list[Any], reply: BaseMessage
    ) -> dict[str, Any]:
        from langchain_agent_memory.engine.prefix import tokenize_prompt

        meta = reply.response_metadata
        text = self._render(self._tokenizer, msgs, [convert_to_openai_tool(t) for t in tools] or None)
        return {
            "agent": agent, "cache": str(meta["cache"]), "ttft_s": float(meta["time_to_first_token_s"]),
            "ids": tokenize_prompt(self._tokenizer, text).ids,
            "out_tokens": int((reply.usage_metadata or {}).get("output_tokens", 1)),
        }  # fmt: skip

    def pause(self, seconds: float) -> None:
        with self._lock:
            self.pauses_s += seconds
        time.sleep(seconds)


def build(llm: Any, saver: Any, thread: int, workers: list[str], seed: int, rec: Recorder) -> Any:
    from langgraph.graph import END, START, StateGraph
    from langgraph.types import interrupt

    prompts = _system_prompts(thread, workers)
    rng = random.Random(seed)
    # The tools stay bound on every turn of a worker, as an agent loop binds them: the
    # system text (which lists them) is then the same turn after turn.
    tools = llm.bind_tools([inventory], tool_choice="inventory").bind(max_tokens=40)  # the whole call
    answers = llm.bind_tools([inventory])

    def sup(state: State) -> dict[str, Any]:
        hist = state["hist"].get("sup", [])
        msgs = [
            SystemMessage(prompts["sup"]),
            *hist,
            HumanMessage(f"Round {state['round']}, step {state['step']}: who is next?"),
        ]
        reply = llm.invoke(msgs)
        return {
            "step": state["step"] + 1,
            "hist": {"sup": [*msgs[1:], reply]},
            "rows": [rec.row("sup", msgs, [], reply)],
        }

    def worker(name: str) -> Any:
        def run(state: State) -> dict[str, Any]:
            hist = state["hist"].get(name, [])
            ask = HumanMessage(f"Round {state['round']}: check stock of item {state['step']}.")
            msgs = [SystemMessage(prompts[name]), *hist, ask]
            call = tools.invoke(msgs)
            assert isinstance(call, AIMessage) and call.tool_calls, call
            rec.pause(rng.uniform(0.2, 2.0))  # the tool runs
            first = call.tool_calls[0]
            result = ToolMessage(str(inventory.invoke(first["args"])), tool_call_id=first["id"])
            answer = answers.invoke([*msgs, call, result])
            rows = [
                rec.row(name, msgs, [inventory], call),
                rec.row(name, [*msgs, call, result], [inventory], answer),
            ]
            return {"hist": {name: [*hist, ask, call, result, answer]}, "rows": rows}

        return run

    def review(state: State) -> dict[str, Any]:
        interrupt("approve this round?")
        return {}

    def route(state: State) -> str:  # the supervisor's turn ``step`` (from 1) set ``step + 1``
        done = state["step"] - 2  # workers run before it
        return workers[done] if done < len(workers) else "review"

    graph = StateGraph(State)
    graph.add_node("sup", sup)
    for name in workers:
        graph.add_node(name, worker(name))
        graph.add_edge(name, "sup")
    graph.add_node("review", review)
    graph.add_edge(START, "sup")
    graph.add_conditional_edges("sup", route, [*workers, "review"])
    graph.add_edge("review", END)
    return graph.compile(checkpointer=saver)


def run_policy(name: str, args: argparse.Namespace, console: Console) -> dict[str, Any]:
    from langgraph.types import Command

    from langchain_agent_memory import AgentMemorySaver, ChatAgentMemory
    from langchain_agent_memory.engine import shared_engine

    eviction, ttl = POLICIES[name]
    workers = [f"w{i + 1}" for i in range(args.workers)]
    with tempfile.TemporaryDirectory(prefix="graph-eviction-") as tmp:
        llm = ChatAgentMemory(model=args.model, cache_dir=tmp, max_tokens=12, hot_budget_mb=args.hot_mb)
        config = dataclasses.replace(
            llm.engine_config(), hot_agents=args.hot_agents, eviction=eviction, tool_ttl_s=ttl
        )
        engine = shared_engine(config)  # the chat model and the saver find this one (same key)
        rec = Recorder(llm)
        rows: list[dict[str, Any]] = []
        lock = threading.Lock()
        with AgentMemorySaver(cache_dir=tmp, model=args.model) as saver:

            def one_thread(t: int) -> None:
                app = build(llm, saver, t, workers, seed=100 + t, rec=rec)
                cfg = {"configurable": {"thread_id": f"run-{t}"}}
                seen = 0
                for r in range(args.rounds):
                    start: dict[str, Any] = {"round": r, "step": 1}
                    app.invoke({**start, "hist": {}, "rows": []} if r == 0 else start, cfg)  # to the review
                    rec.pause(HUMAN_PAUSE_S)  # the human reads, then approves
                    out = app.invoke(Command(resume="ok"), cfg)
                    with lock:
                        rows.extend(dict(row, round=r, thread=t) for row in out["rows"][seen:])
                    seen = len(out["rows"])
                    console.print(f"[dim]  {name}: thread {t}, round {r + 1} of {args.rounds} done[/dim]")

            t0 = time.perf_counter()
            threads = [threading.Thread(target=one_thread, args=(t,)) for t in range(args.threads)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            wall = time.perf_counter() - t0
            stats = engine.stats()
        engine.close()
    return _summary(name, rows, wall, rec.pauses_s, args.threads) | {
        "hot_tier": stats["hot_tier"],
        "rows": rows,
    }


def _summary(
    name: str, rows: list[dict[str, Any]], wall: float, pauses_s: float, threads: int
) -> dict[str, Any]:
    later = [r for r in rows if r["round"] > 0]  # round 0 is cold by construction
    share = {
        k: sum(r["cache"].startswith(k) for r in later) / max(1, len(later)) for k in ("hot", "warm", "cold")
    }
    return {
        "policy": name, "wall_s": wall, "busy_s": wall - pauses_s if threads == 1 else None,
        "turns": len(rows), "later_turns": len(later), "share": share,
        "mean_ttft_s": statistics.mean(r["ttft_s"] for r in later) if later else None,
    }  # fmt: skip


def run_peer(
    model: str, rows: list[dict[str, Any]], hot_agents: int, pauses_s: float, threads: int
) -> dict[str, Any]:
    """The same turns, in the order they ran, through mlx-lm's server-style LRU prompt cache."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache, trim_prompt_cache

    from langchain_agent_memory.engine.config import load_model

    # The engine's own loaded model (float32 weights on the CPU, the project's BLAS): the
    # peer differs in what it keeps, not in the arithmetic. Plain ``mlx_lm.load`` prefills
    # 2K tokens ~4x slower here (stock attention, bf16 weights).
    lm = load_model(model).model
    lru = LRUPromptCache(max_size=hot_agents)
    out = []
    t0 = time.perf_counter()
    for row in rows:
        ids = row["ids"]
        cache, rest = lru.fetch_nearest_cache(model, ids)
        if cache is None:
            cache = make_prompt_cache(lm)
        elif not rest:  # the whole prompt cached: its last token is fed again for the first logits
            trim_prompt_cache(cache, 1)
            rest = ids[-1:]
        reused = len(ids) - len(rest)
        start, ttft, made = time.perf_counter(), 0.0, []
        for token, _ in generate_step(mx.array(rest), lm, prompt_cache=cache, max_tokens=row["out_tokens"]):
            if not made:
                ttft = time.perf_counter() - start
            made.append(int(token))
        lru.insert_cache(model, (ids + made)[: cache[0].offset], cache)
        out.append({**row, "cache": "hot" if reused * 2 >= len(ids) else "cold", "ttft_s": ttft})
    busy = time.perf_counter() - t0
    return _summary(PEER, out, busy + pauses_s / threads, pauses_s, threads) | {"rows": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--workers", type=int, default=11)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hot-agents", type=int, default=4)
    ap.add_argument("--hot-mb", type=int, default=64, help="the pool's memory tier (about 4 agents' blocks)")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args()
    console = Console()
    results = []
    for name in POLICIES:
        console.print(f"[dim]policy {name}…[/dim]")
        results.append(run_policy(name, args, console))
    console.print(f"[dim]{PEER}: the same turns…[/dim]")
    first = results[0]
    pauses = first["wall_s"] - first["busy_s"] if first["busy_s"] is not None else 0.0
    ordered = sorted(first["rows"], key=lambda r: (r["thread"], r["round"]))  # one thread's order
    results.append(run_peer(args.model, ordered, args.hot_agents, pauses, args.threads))
    for r in results:
        for row in r["rows"]:
            row.pop("ids", None)
    data = {"args": {k: str(v) for k, v in vars(args).items()}, "policies": results}
    agents = args.threads * (1 + args.workers)
    table = Table(title=f"{agents} agents, hot tier of {args.hot_agents} (turns after the first round)")
    for c in ("policy", "hot", "warm", "cold", "mean TTFT", "wall", "busy", "vs lru (wall)", "vs lru (busy)"):
        table.add_column(c, justify="right")
    lru = results[0]
    for r in results:
        shares = [f"{r['share'][k]:.0%}" for k in ("hot", "warm", "cold")]
        busy = r["busy_s"]
        timing = [
            f"{r['mean_ttft_s']:.3f} s", f"{r['wall_s']:.1f} s", f"{busy:.1f} s" if busy is not None else "-",
            f"{lru['wall_s'] / r['wall_s']:.2f}×",
            f"{lru['busy_s'] / busy:.2f}×" if busy and lru["busy_s"] else "-",
        ]  # fmt: skip
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
