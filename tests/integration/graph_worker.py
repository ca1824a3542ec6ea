"""A worker process running phases of a LangGraph graph on a shared store: checkpoints,
links and caches in PostgreSQL + the object store (``AgentMemorySaver(store=, blocks=)``),
its own local cache directory. One JSON command per stdin line, one JSON line back:

    {"thread": T, "message": M}  ->  {"replies": [...], "caches": [...], "cached": [...]}
"""

from __future__ import annotations

import json
import sys
from typing import Annotated, TypedDict

from langchain_core.messages import AnyMessage, HumanMessage
from langgraph.graph import START, StateGraph
from langgraph.graph.message import add_messages

from langchain_agent_memory import AgentMemorySaver, ChatAgentMemory


class State(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


def main() -> None:
    cache_dir, store, blocks = sys.argv[1:4]
    llm = ChatAgentMemory(cache_dir=cache_dir, store=store, blocks=blocks, kv_bits=None, max_tokens=8)

    def node(name: str):
        def run(state: State) -> State:
            reply = llm.invoke([("system", f"You are the {name}. " * 60), *state["messages"]])
            return {"messages": [reply]}

        return run

    builder = StateGraph(State)
    builder.add_node("planner", node("planner"))
    builder.add_node("writer", node("writer"))
    builder.add_edge(START, "planner")
    builder.add_edge("planner", "writer")
    with AgentMemorySaver(cache_dir=cache_dir, store=store, blocks=blocks, kv_bits=None) as saver:
        graph = builder.compile(checkpointer=saver)
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd.get("op") == "quit":
                print(json.dumps({"bye": True}), flush=True)
                break
            config = {"configurable": {"thread_id": cmd["thread"]}}
            out = graph.invoke({"messages": [HumanMessage(cmd["message"])]}, config)
            ais = [m for m in out["messages"] if m.type == "ai"][-2:]
            print(json.dumps({
                "replies": [m.content for m in ais],
                "caches": [m.response_metadata["cache"] for m in ais],
                "cached": [m.usage_metadata["input_token_details"]["cache_read"] for m in ais],
                "inputs": [m.usage_metadata["input_tokens"] for m in ais],
            }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
