"""A 5-phase, 4-agent interrogation / negotiation as a LangGraph graph: persistent agent
caches vs caches cleared at every phase, per-phase time to first token and total time.

    .venv/bin/python benchmarks/workflow.py [--model smollm2-135m] [--max-tokens 32]

The case: a company accuses a developer of breaching the Apache License 2.0. Four agents,
each a graph node with its own system prompt holding the whole license (~2.4K tokens):
an investigator, the developer, the developer's counsel and the licensor's negotiator.
Five phases (briefing, interrogation, evidence, negotiation, settlement); in each, all
four speak at once (one super-step, their requests batched), each told what the others
said in the previous phase. Every phase runs in a new process, as phases hours apart
would: the graph resumes from its ``AgentMemorySaver`` checkpoint.

- persistent: each agent's KV cache carries over (read from disk in the new process: the
  first request of a phase extends it with the new turn only);
- cleared: the same checkpoints, but each phase's KV caches start in a new, empty
  directory, so each phase re-reads each agent's whole conversation (what a system
  without persistent caches does).

Writes benchmarks/results/workflow.json and .png.
"""

from __future__ import annotations

import argparse
import json
import operator
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated, Any, TypedDict

HERE = Path(__file__).resolve().parent
THREAD = "case-1"
ROLES = {
    "investigator": "You are the investigator. Ask pointed questions and state facts.",
    "developer": "You are the developer accused of the breach. Defend your use of the code.",
    "counsel": "You are the developer's counsel. Protect your client and cite the license.",
    "negotiator": "You are the licensor's negotiator. Seek a fair settlement.",
}
PHASES = [
    ("briefing", "Phase 1, briefing. State your position on the alleged breach in two sentences."),
    ("interrogation", "Phase 2, interrogation. Answer or ask about whether the NOTICE file was kept."),
    ("evidence", "Phase 3, evidence. Which section of the license matters most here, and why?"),
    ("negotiation", "Phase 4, negotiation. Propose or answer a remedy."),
    ("settlement", "Phase 5, settlement. Accept, reject or amend the proposed remedy, briefly."),
]


class State(TypedDict):
    phase: int
    said: Annotated[list[tuple[int, str, str]], operator.add]  # (phase, agent, text)
    rows: Annotated[list[dict], operator.add]


def build(model: str, cache_dir: Path, max_tokens: int, mode: str, phase: int) -> Any:
    """The graph. Persistent: checkpoints and caches through ``AgentMemorySaver``. Cleared:
    the same checkpoints (``SqliteCheckpoints``) but the agents' KV caches in a new,
    empty directory each phase: nothing of an earlier phase's caches (nor of the blocks
    agents could share) is left to reuse."""
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
    from langgraph.graph import END, START, StateGraph

    from langchain_agent_memory import AgentMemorySaver, ChatAgentMemory, corpus
    from langchain_agent_memory.graph.sqlite_checkpoints import SqliteCheckpoints

    if mode == "persistent":
        kv_dir = cache_dir
        saver: Any = AgentMemorySaver(cache_dir=cache_dir, model=model)
    else:
        kv_dir = cache_dir / f"kv-phase-{phase + 1}"
        saver = SqliteCheckpoints(cache_dir / "checkpoints.sqlite")
    llm = ChatAgentMemory(model=model, cache_dir=str(kv_dir), max_tokens=max_tokens)
    license_text = corpus.apache_license()

    def agent(name: str):  # type: ignore[no-untyped-def]
        system = SystemMessage(f"{ROLES[name]}\n\nThe license in dispute:\n\n{license_text}")

        def turn(p: int, said: list[tuple[int, str, str]]) -> str:
            others = "\n".join(f"{who}: {text}" for ph, who, text in said if ph == p - 1 and who != name)
            heard = f"Last phase the others said:\n{others}\n\n" if others else ""
            return heard + PHASES[p][1]

        def run(state: State) -> dict:
            p = state["phase"]
            history: list[Any] = [system]
            for q in range(p):  # this agent's earlier turns, as they were sent and answered
                mine = next(text for ph, who, text in state["said"] if ph == q and who == name)
                history += [HumanMessage(turn(q, state["said"])), AIMessage(mine)]
            t0 = time.perf_counter()
            reply = llm.invoke([*history, HumanMessage(turn(p, state["said"]))])
            meta, usage = reply.response_metadata, reply.usage_metadata or {}
            row = {
                "phase": p + 1,
                "agent": name,
                "ttft_s": meta["time_to_first_token_s"],
                "call_s": time.perf_counter() - t0,
                "cache": meta["cache"],
                "prompt_tokens": usage.get("input_tokens", 0),
                "cached_tokens": usage.get("input_token_details", {}).get("cache_read", 0),
            }
            return {"said": [(p, name, str(reply.content).strip())], "rows": [row]}

        return run

    g = StateGraph(State)
    for name in ROLES:
        g.add_node(name, agent(name))
        g.add_edge(START, name)
        g.add_edge(name, END)
    return g.compile(checkpointer=saver)


def run_phase(model: str, cache_dir: str, phase: int, mode: str, max_tokens: int) -> dict[str, Any]:
    """One phase in this (new) process."""
    graph = build(model, Path(cache_dir), max_tokens, mode, phase)
    config = {"configurable": {"thread_id": THREAD}}
    state = graph.get_state(config).values if phase else {"said": [], "rows": []}
    t0 = time.perf_counter()
    out = graph.invoke({"phase": phase, "said": [], "rows": []} if not phase else {"phase": phase}, config)
    wall = time.perf_counter() - t0
    rows = [r for r in out["rows"] if r["phase"] == phase + 1]
    assert len(state.get("said", [])) == 4 * phase
    return {"phase": phase + 1, "wall_s": wall, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-tokens", type=int, default=32)
    a = ap.parse_args()
    if a.worker:
        model, cache_dir, phase, mode, max_tokens = a.worker
        print(json.dumps(run_phase(model, cache_dir, int(phase), mode, int(max_tokens))))
        return

    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    console = Console(width=max(Console().width, 110))
    results: dict[str, list[dict]] = {"persistent": [], "cleared": []}
    with Progress(console=console) as progress:
        task = progress.add_task("workflow", total=2 * len(PHASES))
        dirs = {mode: tempfile.mkdtemp(prefix=f"workflow-{mode}-") for mode in results}
        # The modes alternate phase by phase, so both see the same machine load.
        for phase in range(len(PHASES)):
            for mode in results:
                progress.update(task, description=f"phase {phase + 1} ({mode})")
                cmd = [sys.executable, __file__, "--worker", a.model, dirs[mode], str(phase), mode]
                out = subprocess.run([*cmd, str(a.max_tokens)], capture_output=True, text=True, check=False)
                if out.returncode != 0:
                    raise RuntimeError(out.stderr[-3000:])
                r = json.loads(out.stdout.strip().splitlines()[-1])
                results[mode].append(r)
                ttfts = [row["ttft_s"] for row in r["rows"]]
                progress.console.print(
                    f"phase {phase + 1} {mode:<10} wall {r['wall_s']:6.2f} s, "
                    f"TTFT mean {sum(ttfts) / 4:5.2f} s, max {max(ttfts):5.2f} s, "
                    f"caches: {', '.join(row['cache'] for row in r['rows'])}"
                )
                progress.advance(task)

    table = Table(title=f"5-phase, 4-agent workflow, {a.model}: each phase in a new process")
    for col in ("phase", "prompt tokens (mean)", "persistent: TTFT mean / max", "phase wall",
                "cleared: TTFT mean / max", "phase wall", "wall ratio"):  # fmt: skip
        table.add_column(col, justify="right")
    totals = {mode: sum(r["wall_s"] for r in rs) for mode, rs in results.items()}
    for p, c in zip(results["persistent"], results["cleared"], strict=True):

        def ttft(r: dict) -> str:
            t = [row["ttft_s"] for row in r["rows"]]
            return f"{sum(t) / len(t):.2f} / {max(t):.2f} s"

        tokens = sum(row["prompt_tokens"] for row in p["rows"]) / len(p["rows"])
        table.add_row(
            str(p["phase"]), f"{tokens:.0f}", ttft(p), f"{p['wall_s']:.2f} s", ttft(c),
            f"{c['wall_s']:.2f} s", f"{c['wall_s'] / p['wall_s']:.1f}x",
        )  # fmt: skip
    table.add_row(
        "total", "", "", f"{totals['persistent']:.1f} s", "", f"{totals['cleared']:.1f} s",
        f"{totals['cleared'] / totals['persistent']:.1f}x",
    )  # fmt: skip
    console.print(table)

    out = HERE / "results"
    out.mkdir(exist_ok=True)
    payload = {"model": a.model, "max_tokens": a.max_tokens, "phases": results, "total_wall_s": totals}
    (out / "workflow.json").write_text(json.dumps(payload, indent=2))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    xs = [r["phase"] for r in results["persistent"]]
    for mode, color in (("cleared", "C3"), ("persistent", "C0")):
        means = [sum(row["ttft_s"] for row in r["rows"]) / 4 for r in results[mode]]
        ax.plot(xs, means, marker="o", color=color, label=mode)
        ax2.bar([x + (0.2 if mode == "persistent" else -0.2) for x in xs],
                [r["wall_s"] for r in results[mode]], 0.4, color=color, label=mode)  # fmt: skip
    ax.set_yscale("log")
    ax.set_xlabel("phase")
    ax.set_ylabel("mean time to first token (s)")
    ax.legend()
    ax2.set_xlabel("phase")
    ax2.set_ylabel("phase wall time (s)")
    ax2.legend()
    fig.suptitle(f"5-phase, 4-agent workflow ({a.model}): persistent vs cleared caches")
    fig.tight_layout()
    fig.savefig(out / "workflow.png", dpi=120)
    console.print(f"wrote {out / 'workflow.json'} and workflow.png")


if __name__ == "__main__":
    main()
