"""AgentMemorySaver's links between checkpoints and agent caches, on a real LangGraph graph
with ChatAgentMemory nodes: delete frees the files, copy shares blocks and diverges on its
own, prune collects old snapshots, time travel restores the caches of a checkpoint."""

from __future__ import annotations

import operator
from pathlib import Path
from typing import Annotated, TypedDict

import pytest
from langchain_core.messages import AnyMessage, HumanMessage, SystemMessage

from langchain_agent_memory import AgentMemorySaver, ChatAgentMemory, corpus
from langchain_agent_memory.engine.model.loading import LoadedModel
from langchain_agent_memory.graph.linker import SNAPSHOT_PREFIX

SYSTEM = "You answer questions about this license.\n\n" + corpus.apache_license()[:1500]


class State(TypedDict):
    messages: Annotated[list[AnyMessage], operator.add]


def _one_node(llm: ChatAgentMemory, name: str = "lawyer"):  # type: ignore[no-untyped-def]
    """A graph (not compiled) of one node ``name`` that answers with ``llm`` over ``SYSTEM``
    and the thread's messages."""
    from langgraph.graph import END, START, StateGraph

    def answer(state: State) -> dict:
        return {"messages": [llm.invoke([SystemMessage(SYSTEM), *state["messages"]])]}

    g = StateGraph(State)
    g.add_node(name, answer)
    g.add_edge(START, name)
    g.add_edge(name, END)
    return g


def _app(tmp: Path):  # type: ignore[no-untyped-def]
    llm = ChatAgentMemory(cache_dir=str(tmp), max_tokens=6)
    saver = AgentMemorySaver(cache_dir=tmp)
    return _one_node(llm).compile(checkpointer=saver), saver, llm.engine


def _cfg(thread: str) -> dict:
    return {"configurable": {"thread_id": thread}}


def _block_files(tmp: Path) -> set[str]:
    return {p.stem for p in (tmp / "kv").rglob("blocks/*/*.safetensors")}


@pytest.fixture
def two_turns(smollm: LoadedModel, tmp_path: Path):  # type: ignore[no-untyped-def]
    app, saver, engine = _app(tmp_path)
    app.invoke({"messages": [HumanMessage("What is this license called?")]}, _cfg("t1"))
    app.invoke({"messages": [HumanMessage("Who wrote it?")]}, _cfg("t1"))
    return app, saver, engine, tmp_path


def test_every_checkpoint_links_the_cache_it_stood_at(two_turns) -> None:  # type: ignore[no-untyped-def]
    app, saver, engine, _ = two_turns
    history = list(app.get_state_history(_cfg("t1")))
    linked = [saver.linked_agents(s.config) for s in history]
    after_turns = [links for links in linked if links]
    assert all(set(links) == {"t1:lawyer"} for links in after_turns)
    assert len({links["t1:lawyer"] for links in after_turns}) == 2  # one cache state per turn
    snapshots = engine.admin.agent_records(SNAPSHOT_PREFIX)
    assert len(snapshots) == 2
    latest = engine.admin.store.records.get("t1:lawyer")
    assert latest is not None and any(s.blocks == latest.blocks for s in snapshots)


def test_delete_thread_frees_the_cache_files(two_turns) -> None:  # type: ignore[no-untyped-def]
    app, saver, engine, tmp = two_turns
    assert _block_files(tmp)
    saver.delete_thread("t1")
    assert engine.admin.agent_records() == []  # the agent and every snapshot
    assert _block_files(tmp) == set()
    assert app.get_state(_cfg("t1")).values == {}


def test_copy_thread_shares_blocks_and_diverges_on_its_own(two_turns) -> None:  # type: ignore[no-untyped-def]
    app, saver, engine, tmp = two_turns
    before = _block_files(tmp)
    saver.copy_thread("t1", "t2")
    assert _block_files(tmp) == before  # a fork copies no tensors
    source = engine.admin.store.records.get("t1:lawyer")
    fork = engine.admin.store.records.get("t2:lawyer")
    assert source is not None and fork is not None and fork.blocks == source.blocks
    out = app.invoke({"messages": [HumanMessage("Can I sell copies?")]}, _cfg("t2"))
    assert out["messages"][-1].response_metadata["cache"].endswith("-extend")
    assert engine.admin.store.records.get("t1:lawyer") == source  # the source is untouched
    assert engine.admin.cached_tokens("t2:lawyer") > len(source.token_ids)
    assert len(app.get_state(_cfg("t1")).values["messages"]) == 4


def test_prune_collects_the_snapshots_of_pruned_checkpoints(two_turns) -> None:  # type: ignore[no-untyped-def]
    _, saver, engine, tmp = two_turns
    saver.prune(["t1"], strategy="keep_latest")
    snapshots = engine.admin.agent_records(SNAPSHOT_PREFIX)
    assert len(snapshots) == 1
    assert snapshots[0].blocks == engine.admin.store.records.get("t1:lawyer").blocks  # type: ignore[union-attr]
    saver.prune(["t1"], strategy="delete")
    assert engine.admin.agent_records() == [] and _block_files(tmp) == set()


def test_delete_for_runs_drops_that_runs_links_and_snapshot(smollm: LoadedModel, tmp_path: Path) -> None:
    app, saver, engine = _app(tmp_path)
    for run_id, question in (("run-1", "What is this license called?"), ("run-2", "Who wrote it?")):
        app.invoke(
            {"messages": [HumanMessage(question)]}, {"configurable": {"thread_id": "t1", "run_id": run_id}}
        )
    assert len(engine.admin.agent_records(SNAPSHOT_PREFIX)) == 2
    saver.delete_for_runs(["run-2"])
    remaining = list(app.get_state_history(_cfg("t1")))
    assert remaining and all(len(s.values.get("messages", [])) <= 2 for s in remaining)
    linked = {d for s in remaining for d in saver.linked_agents(s.config).values()}
    snapshots = engine.admin.agent_records(SNAPSHOT_PREFIX)
    assert len(linked) == 1 and [s.agent_id for s in snapshots] == [SNAPSHOT_PREFIX + linked.pop()]
    # The turn-1 snapshot's blocks are all still on disk: its checkpoints can be resumed.
    assert set(snapshots[0].blocks) <= _block_files(tmp_path)
    # The thread now ends at turn 1, and so does its agent's cache.
    assert engine.admin.store.records.get("t1:lawyer").text == snapshots[0].text  # type: ignore[union-attr]


def test_time_travel_restores_the_cache_of_that_checkpoint(two_turns) -> None:  # type: ignore[no-untyped-def]
    app, saver, engine, _ = two_turns
    turn1 = next(s for s in app.get_state_history(_cfg("t1")) if len(s.values.get("messages", [])) == 2)
    snapshot = saver.linked_agents(turn1.config)["t1:lawyer"]
    stored_after_turn1 = engine.admin.store.records.get(SNAPSHOT_PREFIX + snapshot)
    assert stored_after_turn1 is not None
    assert len(engine.admin.cached_text("t1:lawyer")) > len(stored_after_turn1.text)  # now at turn 2
    # Resume from turn 1 with another question: the node extends turn 1's cache exactly.
    forked = app.invoke({"messages": [HumanMessage("Is it free?")]}, turn1.config)
    reply = forked["messages"][-1]
    assert reply.response_metadata["cache"].endswith("-extend")  # hot: its blocks are in memory
    assert reply.usage_metadata["input_token_details"]["cache_read"] == len(stored_after_turn1.token_ids)
    # The fork's input checkpoint (put before the node ran) links turn 1's cache, not turn 2's.
    fork_input = next(
        s
        for s in app.get_state_history(_cfg("t1"))
        if s.parent_config == turn1.config and s.metadata["source"] == "input"
    )
    assert saver.linked_agents(fork_input.config)["t1:lawyer"] == snapshot


def test_resuming_prefetches_the_next_nodes_cache_only(smollm: LoadedModel, tmp_path: Path) -> None:
    from langgraph.graph import END, START, StateGraph

    llm = ChatAgentMemory(cache_dir=str(tmp_path), max_tokens=4)
    saver = AgentMemorySaver(cache_dir=tmp_path)

    def agent(name: str):  # type: ignore[no-untyped-def]
        def run(state: State) -> dict:
            system = SystemMessage(f"You are the {name}.\n\n" + SYSTEM)
            return {"messages": [llm.invoke([system, *state["messages"]])]}

        return run

    g = StateGraph(State)
    g.add_node("writer", agent("writer"))
    g.add_node("critic", agent("critic"))
    g.add_edge(START, "writer")
    g.add_edge("writer", "critic")
    g.add_edge("critic", END)
    app = g.compile(checkpointer=saver, interrupt_before=["critic"])
    cfg = _cfg("t1")
    app.invoke({"messages": [HumanMessage("Name the license.")]}, cfg)
    app.invoke(None, cfg)  # the critic runs: both agents now have caches
    app.invoke({"messages": [HumanMessage("Who wrote it?")]}, cfg)  # stops before the critic
    engine = llm.engine
    engine.flush()
    engine.admin.clear_memory()  # as after a restart: nothing live, no block in memory
    assert engine.stats()["hot_agents"] == 0
    saver.get_tuple(cfg)  # what a resume reads first
    assert saver.last_prefetch is not None and saver.last_prefetch.result() == 1
    assert engine.stats()["hot_agents"] == 1  # the critic (next), not the writer
    out = app.invoke(None, cfg)
    meta = out["messages"][-1].response_metadata
    assert meta["agent_id"] == "t1:critic" and meta["cache"] == "hot-extend"
    assert meta["loaded_from"] == "disk, prefetched"  # served from memory, read from disk before the call
    # without a checkpointer nothing is prefetched: read from disk by the call itself
    history = [SystemMessage(SYSTEM), HumanMessage("Name the license.")]
    first = llm.invoke(history, agent_id="solo").response_metadata
    assert first["cache"] == "cold" and first["loaded_from"] is None
    engine.flush()
    engine.admin.clear_memory()
    again = llm.invoke([*history, HumanMessage("Who wrote it?")], agent_id="solo").response_metadata
    assert again["cache"].startswith("warm-") and again["loaded_from"] == "disk"
    last = llm.invoke([*history, HumanMessage("Who wrote it?"), HumanMessage("When?")], agent_id="solo")
    assert last.response_metadata["loaded_from"] == "memory"


def test_browsing_history_changes_no_cache(two_turns) -> None:  # type: ignore[no-untyped-def]
    app, saver, engine, _ = two_turns
    before = engine.admin.store.records.get("t1:lawyer")
    assert before is not None
    # what LangGraph Studio does while a person browses: every state, old ones included
    states = list(app.get_state_history(_cfg("t1")))
    for s in states:
        app.get_state(s.config)
    saver.get_delta_channel_history(config=states[-1].config, channels=["messages"])
    after = engine.admin.store.records.get("t1:lawyer")
    assert after is not None and after.blocks == before.blocks and after.text == before.text
    # the next turn, from the latest checkpoint, extends the latest cache (turn 2's)
    out = app.invoke({"messages": [HumanMessage("Is it free?")]}, _cfg("t1"))
    reply = out["messages"][-1]
    assert reply.response_metadata["cache"].endswith("-extend")
    assert reply.usage_metadata["input_token_details"]["cache_read"] >= len(before.token_ids)


def test_resuming_an_older_checkpoint_rewinds_first(smollm: LoadedModel, tmp_path: Path) -> None:
    llm = ChatAgentMemory(cache_dir=str(tmp_path), max_tokens=4)
    saver = AgentMemorySaver(cache_dir=tmp_path)
    app = _one_node(llm, "critic").compile(checkpointer=saver, interrupt_before=["critic"])
    cfg = _cfg("t1")
    app.invoke({"messages": [HumanMessage("Name the license.")]}, cfg)
    app.invoke(None, cfg)
    app.invoke({"messages": [HumanMessage("Who wrote it?")]}, cfg)
    app.invoke(None, cfg)  # turn 2 answered: the cache holds both turns
    waiting = [s for s in app.get_state_history(cfg) if s.next == ("critic",)]
    second = waiting[0]  # turn 2 asked, not answered
    snapshot = llm.engine.admin.store.records.get(
        SNAPSHOT_PREFIX + saver.linked_agents(second.config)["t1:critic"]
    )
    assert snapshot is not None and "Who wrote it?" not in snapshot.text
    # Resume that pending step with no input: the critic starts from the cache it had there
    # (turn 1), which the prompt extends; without the rewind it would cut turn 2's cache.
    out = app.invoke(None, second.config)
    reply = out["messages"][-1]
    assert reply.response_metadata["cache"].endswith("-extend")
    assert reply.usage_metadata["input_token_details"]["cache_read"] == len(snapshot.token_ids)


def test_saver_conventions_from_conn_string_setup_close(smollm: LoadedModel, tmp_path: Path) -> None:
    # The constructor is cheap: the model is not even resolved until the engine is needed.
    lazy = AgentMemorySaver(model="no-such-model", cache_dir=tmp_path / "lazy")
    with pytest.raises(ValueError, match="unknown model"):
        _ = lazy.engine
    lazy.close()

    builder = _one_node(ChatAgentMemory(cache_dir=str(tmp_path), max_tokens=4))

    def graph(saver: AgentMemorySaver):  # type: ignore[no-untyped-def]
        return builder.compile(checkpointer=saver)

    conn = str(tmp_path / "checkpoints.db")
    with AgentMemorySaver.from_conn_string(conn, cache_dir=tmp_path) as saver:
        saver.setup()  # again: harmless
        graph(saver).invoke({"messages": [HumanMessage("Name the license.")]}, _cfg("t1"))
        first = graph(saver).get_state(_cfg("t1"))
    with AgentMemorySaver.from_conn_string(conn, cache_dir=tmp_path) as saver:
        app = graph(saver)
        assert app.get_state(_cfg("t1")).values == first.values  # the checkpoints persisted
        assert saver.linked_agents(first.config)  # and so did the links
        out = app.invoke({"messages": [HumanMessage("Who wrote it?")]}, _cfg("t1"))
        assert out["messages"][-1].response_metadata["cache"].endswith("-extend")
        clone = saver.with_allowlist([("builtins", "set")])
        assert isinstance(clone, AgentMemorySaver) and clone.linked_agents(first.config)


def test_one_saver_links_every_engine_of_the_graph(smollm: LoadedModel, tmp_path: Path) -> None:
    """Two nodes on two engines (4-bit and 16-bit KV): time travel rewinds both, deleting
    the thread deletes both's caches."""
    from langgraph.graph import END, START, StateGraph

    small = ChatAgentMemory(cache_dir=str(tmp_path), max_tokens=4)
    exact = ChatAgentMemory(cache_dir=str(tmp_path), max_tokens=4, kv_bits=None)
    saver = AgentMemorySaver(cache_dir=tmp_path)

    def node(llm: ChatAgentMemory, role: str):  # type: ignore[no-untyped-def]
        def run(state: State) -> dict:
            return {
                "messages": [
                    llm.invoke([SystemMessage(f"You are the {role}. " + SYSTEM), *state["messages"]])
                ]
            }

        return run

    g = StateGraph(State)
    g.add_node("writer", node(small, "writer"))
    g.add_node("critic", node(exact, "critic"))
    g.add_edge(START, "writer")
    g.add_edge("writer", "critic")
    g.add_edge("critic", END)
    app = g.compile(checkpointer=saver)
    app.invoke({"messages": [HumanMessage("Name the license.")]}, _cfg("t1"))
    app.invoke({"messages": [HumanMessage("Who wrote it?")]}, _cfg("t1"))
    assert {e.fingerprint for e in saver.engines} == {small.engine.fingerprint, exact.engine.fingerprint}
    turn1 = next(s for s in app.get_state_history(_cfg("t1")) if len(s.values.get("messages", [])) == 3)
    linked = saver.linked_agents(turn1.config)
    assert set(linked) == {"t1:writer", "t1:critic"}
    # Resume turn 1 with another question: both agents extend the caches they had there.
    out = app.invoke({"messages": [HumanMessage("Is it free?")]}, turn1.config)
    for reply in out["messages"][-2:]:
        engine = small.engine if reply.response_metadata["agent_id"] == "t1:writer" else exact.engine
        snapshot = engine.admin.store.records.get(
            SNAPSHOT_PREFIX + linked[reply.response_metadata["agent_id"]]
        )
        assert snapshot is not None
        assert reply.response_metadata["cache"].endswith("-extend")
        assert reply.usage_metadata["input_token_details"]["cache_read"] == len(snapshot.token_ids)
    saver.delete_thread("t1")
    for engine in (small.engine, exact.engine):
        assert engine.admin.agent_records() == []
    assert _block_files(tmp_path) == set()


async def test_async_inner_saver_is_called_through_its_async_methods(
    smollm: LoadedModel, tmp_path: Path
) -> None:
    from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver
    from langgraph.graph import END, START, StateGraph

    llm = ChatAgentMemory(cache_dir=str(tmp_path), max_tokens=4)

    async def lawyer(state: State) -> dict:
        return {"messages": [await llm.ainvoke([SystemMessage(SYSTEM), *state["messages"]])]}

    g = StateGraph(State)
    g.add_node("lawyer", lawyer)
    g.add_edge(START, "lawyer")
    g.add_edge("lawyer", END)
    async with AsyncSqliteSaver.from_conn_string(str(tmp_path / "async.db")) as inner:
        saver = AgentMemorySaver(inner, cache_dir=tmp_path)
        app = g.compile(checkpointer=saver)
        await app.ainvoke({"messages": [HumanMessage("Name the license.")]}, _cfg("t1"))
        out = await app.ainvoke({"messages": [HumanMessage("Who wrote it?")]}, _cfg("t1"))
        assert out["messages"][-1].response_metadata["cache"].endswith("-extend")
        history = [s async for s in app.aget_state_history(_cfg("t1"))]
        assert all(saver.linked_agents(s.config) for s in history if len(s.values.get("messages", [])) >= 2)
        await saver.adelete_thread("t1")
        assert (await app.aget_state(_cfg("t1"))).values == {}
        assert llm.engine.admin.agent_records() == [] and _block_files(tmp_path) == set()
        saver.close()
    async with AgentMemorySaver.afrom_conn_string(str(tmp_path / "cp.db"), cache_dir=tmp_path) as saver:
        app = g.compile(checkpointer=saver)
        out = await app.ainvoke({"messages": [HumanMessage("Name the license.")]}, _cfg("t2"))
        assert saver.linked_agents((await app.aget_state(_cfg("t2"))).config)


async def test_langgraph_server_example_runs_on_server_checkpointer(
    smollm: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """examples/langgraph_server: what ``langgraph dev`` loads from its langgraph.json."""
    import importlib.util
    import json

    from langchain_agent_memory.checkpoint import server_checkpointer  # the public path

    folder = Path(__file__).resolve().parents[2] / "examples" / "langgraph_server"
    config = json.loads((folder / "langgraph.json").read_text())
    assert config["checkpointer"]["path"] == "./graph.py:checkpointer"
    spec = importlib.util.spec_from_file_location("example_graph", folder / "graph.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.checkpointer is server_checkpointer
    monkeypatch.setenv("AGENT_MEMORY_CACHE_DIR", str(tmp_path))
    module.llm.max_tokens = 6
    module.llm.cache_dir = str(tmp_path)
    async with module.checkpointer() as saver:
        app = module.graph.builder.compile(checkpointer=saver)
        await app.ainvoke({"messages": [HumanMessage("What is a KV cache?")]}, _cfg("t1"))
        out = await app.ainvoke({"messages": [HumanMessage("Shorter, please.")]}, _cfg("t1"))
        assert out["messages"][-1].response_metadata["cache"].endswith("-extend")
        state = await app.aget_state(_cfg("t1"))
        assert set(saver.linked_agents(state.config)) == {"t1:writer", "t1:critic"}


def test_checkpoints_in_postgres(smollm: LoadedModel, tmp_path: Path, postgres_url: str) -> None:
    """``from_conn_string("postgresql://...")``: checkpoints in a real PostgreSQL server, the
    caches linked to them; copy_thread and delete_for_runs (missing from LangGraph's own
    PostgresSaver) work on it."""
    llm = ChatAgentMemory(cache_dir=str(tmp_path), max_tokens=4)
    with AgentMemorySaver.from_conn_string(postgres_url, cache_dir=tmp_path) as saver:
        app = _one_node(llm).compile(checkpointer=saver)
        for run_id, question in (("run-1", "Name the license."), ("run-2", "Who wrote it?")):
            config = {"configurable": {"thread_id": "pg"}, "metadata": {"run_id": run_id}}
            out = app.invoke({"messages": [HumanMessage(question)]}, config)
        assert out["messages"][-1].response_metadata["cache"].endswith("-extend")
        assert saver.linked_agents(app.get_state(_cfg("pg")).config)
        saver.copy_thread("pg", "pg-copy")
        assert app.get_state(_cfg("pg-copy")).values == app.get_state(_cfg("pg")).values
        assert llm.engine.admin.store.records.get("pg-copy:lawyer") is not None
        saver.delete_for_runs(["run-2"])
        assert len(app.get_state(_cfg("pg")).values["messages"]) == 2  # back to after run 1


def test_the_saver_takes_what_sqlitesaver_takes_and_says_what_it_does_not(tmp_path: Path) -> None:
    """SqliteSaver habits: a ``sqlite3`` connection or a SQLite path work as the inner
    checkpoints; a PostgreSQL URL or another object is refused with what to do instead."""
    import sqlite3

    from langgraph.checkpoint.base import empty_checkpoint

    conn = sqlite3.connect(str(tmp_path / "ckpt.db"), check_same_thread=False)
    for given in (conn, str(tmp_path / "by-path.db"), tmp_path / "by-pathlib.db"):
        with AgentMemorySaver(given, cache_dir=tmp_path / "cache") as saver:
            config = {"configurable": {"thread_id": "t", "checkpoint_ns": ""}}
            saved = saver.put(config, empty_checkpoint(), {"source": "input", "step": -1}, {})
            assert saver.get_tuple(saved) is not None
    with pytest.raises(TypeError, match="from_conn_string"):
        AgentMemorySaver("postgresql://localhost/x", cache_dir=tmp_path / "cache")
    with pytest.raises(TypeError, match="sqlite3 connection or a SQLite path"):
        AgentMemorySaver(42, cache_dir=tmp_path / "cache")  # type: ignore[arg-type]
