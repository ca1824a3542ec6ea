"""Which agent cache a chat-model call uses.

1. An explicit ``agent_id`` (on the model or per call) wins.
2. Inside a LangGraph run: ``{thread_id}:{node path}``, where the node path is the
   ``langgraph_checkpoint_ns`` with each ``:task-id`` suffix removed and subgraph levels
   joined by ``|`` — every (thread, node) pair has its own cache, a subgraph's nodes are
   nested under the parent node, and the same node resumes the same cache on the next
   super-step or after a restart. Without a thread id (no checkpointer) the thread part is
   ``no-thread``. A ``Send`` task (a map step's item) gets its own cache: ``#{index}`` of
   the push in its step (``langgraph_path``), so a map-reduce over eight ``Send``s runs as
   eight agents decoding together, and the next round's item ``k`` extends item ``k``'s.
   The same goes for the items of ``llm.batch([...])``: ``#{index in the batch}``.
3. Otherwise ``DEFAULT_AGENT_ID``. Every call outside a graph then shares one cache; text
   matching keeps that correct (a different conversation only reuses the common prefix),
   and an ``agent_id`` gives each conversation its own.

>>> agent_namespace(None, {"thread_id": "t1", "langgraph_checkpoint_ns": "writer:5f0c"})
't1:writer'
>>> agent_namespace(None, {"thread_id": "t1", "langgraph_checkpoint_ns": "team:1a|critic:9b"})
't1:team|critic'
>>> agent_namespace("researcher", {"thread_id": "t1"})
'researcher'
>>> agent_namespace(None, {})
'default'
>>> agent_namespace(None, {"thread_id": "t1", "langgraph_checkpoint_ns": "map:5f0c",
...                        "langgraph_path": ("__pregel_push", 3, False)})
't1:map#3'
>>> agent_namespace(None, {BATCH_INDEX: 2})
'default#2'
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

DEFAULT_AGENT_ID = "default"
NO_THREAD = "no-thread"
#: Run-metadata key ``ChatAgentMemory.batch`` sets on each item's config.
BATCH_INDEX = "agent_memory_batch_index"
_PUSH = "__pregel_push"


def node_path(checkpoint_ns: str) -> str:
    """``"parent:task|child:task"`` -> ``"parent|child"`` (LangGraph forbids ``:`` and ``|``
    in node names, so the split is exact)."""
    return "|".join(part.split(":", 1)[0] for part in checkpoint_ns.split("|") if part)


def agent_namespace(explicit: str | None, metadata: Mapping[str, Any] | None) -> str:
    """The agent id for a call, from an explicit id or the run's metadata (LangChain copies
    ``configurable`` scalars such as ``thread_id`` into it; LangGraph adds
    ``langgraph_checkpoint_ns`` and ``langgraph_node``)."""
    if explicit:
        return explicit
    meta = metadata or {}
    suffix = f"#{meta[BATCH_INDEX]}" if isinstance(meta.get(BATCH_INDEX), int) else ""
    ns = meta.get("langgraph_checkpoint_ns")
    path = node_path(ns) if isinstance(ns, str) and ns else meta.get("langgraph_node")
    if not path:
        return DEFAULT_AGENT_ID + suffix
    task = meta.get("langgraph_path")
    if isinstance(task, (tuple, list)) and len(task) > 1 and task[0] == _PUSH and isinstance(task[1], int):
        path += f"#{task[1]}"
    thread = meta.get("thread_id")
    return f"{thread if thread not in (None, '') else NO_THREAD}:{path}{suffix}"
