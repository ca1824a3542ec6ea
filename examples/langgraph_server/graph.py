"""A two-agent graph for ``langgraph dev`` (run it from this folder): every agent keeps its
KV cache across the server's runs and restarts, and the server's checkpointer links each
checkpoint to those caches (``server_checkpointer``), so Studio's time travel resumes warm.

    pip install "langgraph-cli[inmem]"
    langgraph dev
"""

# No ``from __future__ import annotations``: LangGraph reads State's annotations at run time,
# and a server may load this file without registering it as a module.
import operator
from typing import Annotated, TypedDict

from langchain_core.messages import AnyMessage, SystemMessage
from langgraph.graph import END, START, StateGraph

from langchain_agent_memory import ChatAgentMemory
from langchain_agent_memory.checkpoint import server_checkpointer as checkpointer

__all__ = ["checkpointer", "graph"]

llm = ChatAgentMemory(max_tokens=96)


class State(TypedDict):
    messages: Annotated[list[AnyMessage], operator.add]


def writer(state: State) -> dict:
    return {"messages": [llm.invoke([SystemMessage("You write short, clear answers."), *state["messages"]])]}


def critic(state: State) -> dict:
    review = [SystemMessage("You point out the weakest sentence of the last answer."), *state["messages"]]
    return {"messages": [llm.invoke(review)]}


builder = StateGraph(State)
builder.add_node("writer", writer)
builder.add_node("critic", critic)
builder.add_edge(START, "writer")
builder.add_edge("writer", "critic")
builder.add_edge("critic", END)
graph = builder.compile()  # the server supplies the checkpointer
