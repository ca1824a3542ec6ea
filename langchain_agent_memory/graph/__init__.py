"""LangGraph's side: the checkpointer (AgentMemorySaver), its links and checkpoint backends."""
