"""Two agents of a LangGraph graph on the embedded default model, three turns each, with a
per-turn time-to-first-token table.

Each agent is a graph node that calls ``ChatAgentMemory()``; its KV cache is picked by
(thread, node), so the two agents never share one. Each has a system prompt of real text
(>= 1K tokens): a licensing assistant that holds the Apache License 2.0, and a Python
tutor that holds three topics of the Python reference manual. Every turn re-sends the
whole conversation, as a chat app does; the engine recognises the agent's earlier text and
prefills only the new turn. The graph is checkpointed by ``AgentMemorySaver`` (in the cache
directory, beside the caches): run it again and the same thread resumes after the restart,
its conversations and its agents' caches together. Their caches come back from disk ahead of
their calls: the checkpointer prefetches the agents of the thread's next turn as it resumes,
so that turn prints ``hot-extend (prefetched)`` (served from memory, read from disk before
the call; ``warm-extend`` where a call came before its prefetch ended: read during the call).

    python examples/quickstart.py [--max-tokens 48] [--model smollm2-135m] [--fresh]
"""

from __future__ import annotations

import argparse
import operator
import time
from typing import Annotated, TypedDict

from langchain_core.messages import AnyMessage, HumanMessage, SystemMessage
from langgraph.graph import END, START, StateGraph
from rich.console import Console
from rich.table import Table

from langchain_agent_memory import AgentMemorySaver, ChatAgentMemory, corpus

THREAD = "quickstart"


def team() -> dict[str, tuple[str, list[str]]]:
    """node name -> (system prompt, one question per turn)."""
    lic = corpus.apache_license()
    py = "\n\n".join(corpus.python_docs_topic(t) for t in ("assert", "for", "exceptions"))
    return {
        "licensing": (
            "You are a licensing assistant. Answer briefly, using this license text:\n\n" + lic,
            [
                "What is the name of this license?",
                "Can I use the licensed work commercially?",
                "Do I have to keep the copyright notice?",
            ],
        ),
        "python_tutor": (
            "You are a Python tutor. Answer briefly, using this part of the Python reference:\n\n" + py,
            [
                "What does the assert statement do?",
                "Write a for loop that prints the numbers 0 to 2.",
                "What happens when an exception is not handled?",
            ],
        ),
    }


class State(TypedDict):
    turn: int
    licensing: Annotated[list[AnyMessage], operator.add]
    python_tutor: Annotated[list[AnyMessage], operator.add]
    rows: Annotated[list[tuple], operator.add]


def agent_node(llm: ChatAgentMemory, name: str, system: str, questions: list[str]):  # type: ignore[no-untyped-def]
    def run(state: State) -> dict:
        question = HumanMessage(questions[state["turn"] % len(questions)])
        history = state[name]  # type: ignore[literal-required]
        reply = llm.invoke([SystemMessage(system), *history, question])
        meta, usage = reply.response_metadata, reply.usage_metadata or {}
        row = (
            meta["agent_id"],
            state["turn"] + 1,
            usage.get("input_tokens", 0),
            usage.get("input_token_details", {}).get("cache_read", 0),
            # after a restart the saver loads the next agents from disk before their calls
            meta["cache"] + (" (prefetched)" if meta["loaded_from"] == "disk, prefetched" else ""),
            meta["time_to_first_token_s"],
            usage.get("output_tokens", 0) / meta["decode_s"] if meta["decode_s"] else 0.0,
            question.content,
            reply.content.strip(),
        )
        return {name: [question, reply], "rows": [row]}

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="shipped model name or mlx-lm directory")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--fresh", action="store_true", help="delete the agents' caches first")
    args = ap.parse_args()

    console = Console(width=max(Console().width, 110))  # keep the table whole in logs
    llm = ChatAgentMemory(model=args.model, max_tokens=args.max_tokens)
    t0 = time.perf_counter()
    with console.status("loading the model (converted once on first use)"):
        engine = llm.engine
    console.print(
        f"model [bold]{engine.lm.name}[/] ready in {time.perf_counter() - t0:.1f} s; "
        f"KV format {engine.quant.label}; caches in {engine.admin.store.dir}"
    )

    graph = StateGraph(State)
    previous = START
    for name, (system, questions) in team().items():
        graph.add_node(name, agent_node(llm, name, system, questions))
        graph.add_edge(previous, name)
        previous = name
    graph.add_edge(previous, END)
    saver = AgentMemorySaver()  # checkpoints and caches in the same cache directory
    app = graph.compile(checkpointer=saver)
    config = {"configurable": {"thread_id": THREAD}}
    if args.fresh:
        saver.delete_thread(THREAD)  # the conversation and its agents' caches
    # A run after a restart resumes the thread where the last one left it.
    before = app.get_state(config).values
    done, shown = len(before.get("licensing", [])) // 2, len(before.get("rows", []))
    if done:
        console.print(
            f"resuming thread [bold]{THREAD}[/] after {done} turns (the checkpointer reads its "
            "agents' caches from disk ahead of their calls: prefetched)"
        )
    state: dict = {}
    for turn in range(done, done + 3):  # the checkpointer carries each agent's history to the next turn
        state = app.invoke({"turn": turn, "licensing": [], "python_tutor": [], "rows": []}, config)
    table = Table(title="time to first token per turn")
    for col in ("agent (thread:node)", "turn", "prompt tokens", "reused", "cache", "TTFT s", "decode tok/s"):
        table.add_column(col, justify="right")
    for agent, turn, prompt_tokens, reused, cache, ttft, tps, question, answer in state["rows"][shown:]:
        console.print(f"[bold]{agent}[/] turn {turn}: {question}\n  -> {answer}")
        table.add_row(agent, str(turn), str(prompt_tokens), str(reused), cache, f"{ttft:.2f}", f"{tps:.1f}")
    console.print(table)
    saver.close()


if __name__ == "__main__":
    main()
