"""The hot tier evicts by when each agent runs next (``caches.schedule``), on the real default
model: the agent a graph runs next stays while one used more recently goes; one waiting on a
human goes first; one whose reply made tool calls stays for its tools; with nothing said,
least recently used. A LangGraph run through ``AgentMemorySaver`` says it by itself."""

from __future__ import annotations

import operator
from pathlib import Path
from typing import Annotated, Any, TypedDict

from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.tools import tool
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, Send, interrupt

from langchain_agent_memory import AgentMemorySaver, ChatAgentMemory
from langchain_agent_memory.engine.caches.schedule import Need, Schedule
from langchain_agent_memory.engine.engine import Engine, GenerationParams, GenerationResult
from langchain_agent_memory.engine.model.loading import LoadedModel
from langchain_agent_memory.engine.results import CacheSource

SHORT = GenerationParams(max_tokens=2)


def _prompt(agent: str) -> str:
    return f"You are agent {agent}. Summarize in one word what a {agent}-shaped cloud is.\n"


def test_the_hot_tier_keeps_the_agent_that_runs_next_and_drops_the_one_a_human_holds(
    smollm: LoadedModel, tmp_path: Path
) -> None:
    engine = Engine(smollm.path, cache_dir=tmp_path, hot_agents=2)

    def turn(agent: str, prompt: str) -> GenerationResult:
        result = engine.generate(agent, prompt, SHORT)
        engine.flush()  # its save written: an agent whose save is pending is never evicted
        return result

    try:
        replies = {a: turn(a, _prompt(a)) for a in ("a", "b")}
        engine.admin.schedule.runs_next(["a"])  # a graph's next step is a's
        turn("c", _prompt("c"))
        assert engine.admin.hot_agents() == ["a", "c"]  # least recently used would have kept b
        again = turn("a", _prompt("a") + replies["a"].text + " And why?")
        assert again.outcome.source is CacheSource.HOT  # its turn came: served from memory

        engine.admin.schedule.waits(["a"])  # a now waits on a human: it goes first
        turn("d", _prompt("d"))
        assert engine.admin.hot_agents() == ["c", "d"]

        turn("e", _prompt("e"))  # nothing said of c or d: by recency
        assert engine.admin.hot_agents() == ["d", "e"]
        stats = engine.stats()
        assert stats["turns"] == {"cold": 5, "hot": 1} and stats["hot_rate"] == 1 / 6
        assert stats["hot_tier"]["evictions"] == 3 and stats["hot_tier"]["max_agents"] == 2
    finally:
        engine.close()


def test_a_prefetch_never_pushes_out_an_agent_needed_sooner(smollm: LoadedModel, tmp_path: Path) -> None:
    """Loading an agent ahead of its turn (a graph's step after next) takes the place of one
    nothing was said of, never of one whose turn comes sooner."""
    engine = Engine(smollm.path, cache_dir=tmp_path, hot_agents=2)
    try:
        for agent in ("a", "b", "c"):
            engine.generate(agent, _prompt(agent), SHORT)
            engine.flush()
        assert engine.admin.hot_agents() == ["b", "c"]  # a was evicted: on disk only
        engine.admin.schedule.runs_next(["b", "c"])
        engine.admin.schedule.runs_soon(["a"])
        assert engine.admin.prefetch(["a"]).result(timeout=60) == 0  # b and c run sooner
        assert engine.admin.hot_agents() == ["b", "c"]
        engine.admin.schedule.started("b")  # b's turn came: nothing is said of it now
        assert engine.admin.prefetch(["a"]).result(timeout=60) == 1
        assert engine.admin.hot_agents() == ["c", "a"]
        again = engine.generate("a", _prompt("a") + " And why?", SHORT)
        assert again.outcome.source is CacheSource.HOT
    finally:
        engine.close()


def test_a_byte_bound_evicts_as_the_agent_count_does(smollm: LoadedModel, tmp_path: Path) -> None:
    engine = Engine(smollm.path, cache_dir=tmp_path, hot_agents=16)
    try:
        engine.generate("a", _prompt("a"), SHORT)
        engine.flush()
        one = engine.stats()["hot_tier"]["bytes"]
        assert one > 0
        engine.agents.policy.max_bytes = int(one * 2.5)  # room for two such agents
        for agent in ("b", "c"):
            engine.generate(agent, _prompt(agent), SHORT)
            engine.flush()
        assert len(engine.admin.hot_agents()) == 2 and engine.stats()["hot_tier"]["bytes"] <= one * 2.5
    finally:
        engine.close()


def test_what_was_said_expires_and_a_request_spends_it() -> None:
    now = [0.0]
    schedule = Schedule(tool_ttl_s=5.0, hint_ttl_s=60.0, clock=lambda: now[0])
    schedule.runs_next(["n"])
    schedule.waits(["w"])
    schedule.awaits_tool("t")
    schedule.runs_soon(["s", "n"])  # a step later: n stays next
    assert schedule.eviction_order(["n", "s", "t", "u", "w"]) == ["w", "u", "s", "t", "n"]
    assert schedule.told() == {"waiting": 1, "soon": 1, "tool": 1, "next": 1}
    now[0] = 6.0  # the tool did not come back in time: ranked as any other
    assert schedule.need("t") is Need.UNKNOWN and schedule.eviction_order(["u", "t"]) == ["u", "t"]
    schedule.started("n")  # its turn came
    assert schedule.need("n") is Need.UNKNOWN
    now[0] = 61.0  # a thread abandoned mid-run pins nothing
    assert schedule.need("w") is Need.UNKNOWN


@tool
def add_two(x: int) -> int:
    """Add two to a number."""
    return x + 2


def test_a_reply_that_calls_a_tool_keeps_its_agent_for_the_result(tmp_path: Path) -> None:
    llm = ChatAgentMemory(model="smollm2-135m", cache_dir=str(tmp_path), agent_id="caller")
    reply = llm.bind_tools([add_two], tool_choice="add_two").invoke([HumanMessage("What is add_two(3)?")])
    assert isinstance(reply, AIMessage) and reply.tool_calls
    schedule = llm.engine.admin.schedule
    assert schedule.need("caller") is Need.TOOL


class _State(TypedDict):
    topic: str
    notes: Annotated[list[str], operator.add]


def test_a_graph_says_who_runs_next_and_who_waits_on_a_human(tmp_path: Path) -> None:
    llm = ChatAgentMemory(model="smollm2-135m", cache_dir=str(tmp_path), max_tokens=2)

    def step(name: str) -> Any:
        def run(state: _State) -> dict[str, Any]:
            return {"notes": [str(llm.invoke(f"{name}: {state['topic']}").content)]}

        return run

    def ask(state: _State) -> dict[str, Any]:
        return {"notes": [str(interrupt("publish?"))]}

    def fan(state: _State) -> list[Send]:
        return [Send("worker", state) for _ in range(2)]

    graph = StateGraph(_State)
    graph.add_node("plan", step("plan"))
    graph.add_node("worker", step("worker"))
    graph.add_node("ask", ask)
    graph.add_edge(START, "plan")
    graph.add_conditional_edges("plan", fan, ["worker"])
    graph.add_edge("worker", "ask")
    graph.add_edge("ask", END)
    with AgentMemorySaver(cache_dir=tmp_path, kv_bits=None) as saver:
        config = {"configurable": {"thread_id": "t 1"}}
        app = graph.compile(checkpointer=saver)
        app.invoke({"topic": "clouds", "notes": []}, config)  # stops at the interrupt
        schedule = llm.engine.admin.schedule
        agents = ["t 1:plan", "t 1:worker#0", "t 1:worker#1"]
        assert [schedule.need(a) for a in agents] == [Need.WAITING] * 3
        app.invoke(Command(resume="yes"), config)

        # The next run stops before the workers: their agents (Send tasks) run next.
        paused = graph.compile(checkpointer=saver, interrupt_before=["worker"])
        paused.invoke({"topic": "rain", "notes": []}, config)
        assert [schedule.need(a) for a in agents] == [Need.UNKNOWN, Need.NEXT, Need.NEXT]
