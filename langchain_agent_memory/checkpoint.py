"""``AgentMemorySaver`` where it was first imported from (``langchain_agent_memory.checkpoint``:
a LangGraph server's ``langgraph.json`` names ``server_checkpointer`` here); it lives in
``graph/saver.py``."""

from .graph.saver import AgentMemorySaver, server_checkpointer

__all__ = ["AgentMemorySaver", "server_checkpointer"]
