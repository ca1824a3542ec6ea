"""``agent-memory chat``: a terminal conversation with one agent that survives restarts.

The conversation is a one-node LangGraph graph checkpointed by ``AgentMemorySaver`` (in
the cache directory, thread ``chat:{agent}``): quitting and running the command again
resumes both the messages and the agent's KV cache, so the first reply after a restart
comes from disk, not from re-reading the conversation. Commands:

- ``/history``: the conversation so far;
- ``/undo``: forget the last exchange (time travel to the checkpoint before it: the
  agent's cache goes back with it);
- ``/reset``: delete the conversation and its cache;
- ``/exit`` (or end of input): quit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from langchain_core.messages import AIMessage, AnyMessage, BaseMessage, HumanMessage, SystemMessage
from langchain_core.runnables import RunnableConfig
from langgraph.graph import START, MessagesState, StateGraph
from rich.console import Console

from ..chat.model import ChatAgentMemory
from ..graph.saver import AgentMemorySaver
from .common import chat_cache_id, chat_thread

#: The REPL's commands and what each does (``/help`` prints them).
COMMANDS = {
    "/help": "show these commands",
    "/history": "show the conversation so far",
    "/undo": "forget the last exchange (the cache goes back with it)",
    "/reset": "delete the conversation and its cache",
    "/exit": "leave (the conversation stays: come back later and it resumes warm)",
}


@dataclass
class ChatOptions:
    agent: str = "chat"
    model: str | None = None
    system: str | None = None
    max_tokens: int = 128
    temperature: float = 0.0
    repetition_penalty: float | None = 1.1
    kv_bits: int | None = 4
    cache_dir: str | None = None


class ChatSession:
    """The graph, its checkpointer and the thread of one agent's conversation."""

    def __init__(self, options: ChatOptions) -> None:
        self.options = options
        self.llm = ChatAgentMemory(
            model=options.model,
            max_tokens=options.max_tokens,
            temperature=options.temperature,
            repetition_penalty=options.repetition_penalty,
            kv_bits=options.kv_bits,  # type: ignore[arg-type]
            cache_dir=options.cache_dir,
        )
        self.saver = AgentMemorySaver(
            cache_dir=options.cache_dir, model=options.model, kv_bits=options.kv_bits
        )
        system = [SystemMessage(options.system)] if options.system else []

        def assistant(state: MessagesState) -> dict[str, list[AnyMessage]]:
            return {"messages": [self.llm.invoke([*system, *state["messages"]])]}

        builder = StateGraph(MessagesState)
        builder.add_node("assistant", assistant)
        builder.add_edge(START, "assistant")
        self.graph = builder.compile(checkpointer=self.saver)
        self.thread: RunnableConfig = {"configurable": {"thread_id": chat_thread(options.agent)}}

    @property
    def messages(self) -> list[BaseMessage]:
        return list(self.graph.get_state(self.thread).values.get("messages", []))

    def ask(self, text: str, on_token: Callable[[str], None]) -> AIMessage:
        """One turn; the reply's text goes to ``on_token`` as it is decoded."""
        turn = {"messages": [HumanMessage(text)]}
        for chunk, _ in self.graph.stream(turn, self.thread, stream_mode="messages"):
            if isinstance(chunk, AIMessage) and chunk.text:
                on_token(chunk.text)
        reply = self.graph.get_state(self.thread).values["messages"][-1]
        assert isinstance(reply, AIMessage)
        return reply

    def undo(self) -> bool:
        """Go back to before the last exchange; False when there is none."""
        n = len(self.messages)
        if n < 2:
            return False
        for snapshot in self.graph.get_state_history(self.thread):
            if len(snapshot.values.get("messages", [])) == n - 2:
                # A new latest checkpoint forked from that one: reading it sets the agent's
                # cache back too (AgentMemorySaver's time travel), and both persist.
                self.graph.update_state(snapshot.config, {"messages": []}, as_node="assistant")
                return True
        return False

    def reset(self) -> None:
        self.saver.delete_thread(self.thread["configurable"]["thread_id"])


def describe(reply: AIMessage, agent: str | None = None) -> str:
    """One line on how a reply was served: whose cache (``agent``: its ``--agent`` name and
    the cache id the cache commands also take), cache outcome, reused tokens, time to first
    token, speed."""
    meta, usage = reply.response_metadata, reply.usage_metadata or {}
    whose = f"agent {agent} (cache {chat_cache_id(agent)}) " if agent else ""
    cached = (usage.get("input_token_details") or {}).get("cache_read", 0)
    out = usage.get("output_tokens", 0)
    speed = f", {out / meta['decode_s']:.1f} tok/s" if meta.get("decode_s") else ""
    prompt = usage.get("input_tokens", 0)
    loaded = meta.get("loaded_from")
    where = f" (read from {loaded})" if loaded and loaded != "memory" else ""
    return (
        f"{whose}{meta.get('cache', '?')}{where}: {cached} of {prompt} prompt tokens from cache, "
        f"first token in {meta.get('time_to_first_token_s', 0):.2f} s{speed}"
    )


def run(options: ChatOptions, console: Console, read: Callable[[str], str] | None = None) -> None:
    read = read or console.input
    session = ChatSession(options)
    past = session.messages
    where = f"agent [bold]{options.agent}[/bold] on {session.llm.model_name}"
    if past:
        console.print(f"resuming {where}: {len(past)} messages (/history shows them)")
    else:
        console.print(f"new conversation with {where}")
    console.print(f"[dim]commands: {' '.join(COMMANDS)}[/dim]")
    while True:
        try:
            line = read("[bold green]you>[/bold green] ").strip()
        except (EOFError, KeyboardInterrupt):
            console.print()
            return
        if not line:
            continue
        if line == "/exit":
            return
        if line in ("/help", "/?"):
            for command, what in COMMANDS.items():
                console.print(f"  {command:<9} {what}")
        elif line == "/history":
            _history(console, session.messages)
        elif line == "/undo":
            console.print("undone: the last exchange is forgotten" if session.undo() else "nothing to undo")
        elif line == "/reset":
            session.reset()
            console.print("conversation and cache deleted")
        elif line.startswith("/"):
            console.print(f"unknown command {line!r}; commands: {' '.join(COMMANDS)}")
        else:
            console.print("[bold blue]agent>[/bold blue] ", end="")
            reply = session.ask(line, lambda t: console.print(t, end="", markup=False, highlight=False))
            console.print()
            console.print(f"[dim]{describe(reply)}[/dim]")


def _history(console: Console, messages: list[Any]) -> None:
    if not messages:
        console.print("no messages yet")
    for m in messages:
        who = "you" if isinstance(m, HumanMessage) else "agent"
        console.print(f"[bold]{who}>[/bold] ", end="")
        console.print(m.text, markup=False, highlight=False)
