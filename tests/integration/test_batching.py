"""Concurrent agents on one engine: their decode steps run as one batched forward pass
(different cache lengths, different positions), their prefills interleave. Oracles: each
agent's greedy output in the batch equals its output run alone, token for token, and the
caches it leaves equal the ones a run alone leaves."""

from __future__ import annotations

import operator
import shutil
import threading
import time
from pathlib import Path
from typing import Annotated, Any, TypedDict

import pytest
from langchain_core.messages import HumanMessage, SystemMessage

from langchain_agent_memory import ChatAgentMemory, corpus
from langchain_agent_memory.engine.engine import Engine, GenerationParams, GenerationResult
from langchain_agent_memory.engine.kv.stored_batch import StoredBatch
from langchain_agent_memory.engine.ops.runtime import mx

PROMPTS = {
    "lawyer": "You answer questions about this license.\n\n"
    + corpus.apache_license()[:900]
    + "\n\nQ: Its name?\nA:",
    "tutor": "You teach Python.\n\n"
    + corpus.python_docs_topic("while")[:500]
    + "\n\nQ: What does while do?\nA:",
    "poet": "Write a short poem about the sea.\n",
}
GREEDY = GenerationParams(max_tokens=12)


@pytest.mark.parametrize("attention", ["copy", "stored"])
@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_batched_decode_equals_decode_alone(
    model: str,
    attention: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    figures: dict[str, str],
    together: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Served from the stored form, the full-attention layers of the batch attend in one
    call over the agents' stored forms (``StoredBatch``); over working copies, in one call
    over their merged copies."""
    request.getfixturevalue("smollm" if model.startswith("smollm") else "gemma")
    built: list[int] = []
    of = StoredBatch.of.__func__  # type: ignore[attr-defined]
    monkeypatch.setattr(
        StoredBatch, "of", classmethod(lambda cls, caches: built.append(len(caches)) or of(cls, caches))
    )
    joined: list[int] = []  # members joining a stored batch in place (not a rebuild)
    extend = StoredBatch.extend
    monkeypatch.setattr(
        StoredBatch, "extend", lambda self, caches: joined.append(len(caches)) or extend(self, caches)
    )
    alone = Engine(model, cache_dir=tmp_path / "alone", attention=attention)
    expected = {agent: alone.generate(agent, prompt, GREEDY) for agent, prompt in PROMPTS.items()}
    batched = Engine(model, cache_dir=tmp_path / "batched", attention=attention)
    got = together(batched, PROMPTS, GREEDY)
    assert batched.stats()["max_decode_batch"] >= 2  # the decodes did run together
    assert (max(built, default=0) >= 2) is (attention == "stored")  # one stored batch of them
    # The agents' prompts differ in length: they start decoding at different steps, so the
    # stored batch forms with two and the third joins it (and they leave one by one).
    assert bool(joined) is (attention == "stored")
    worst = 0.0
    for agent in PROMPTS:
        assert got[agent].text == expected[agent].text, agent
        assert got[agent].completion_tokens == expected[agent].completion_tokens
        a, b = alone.admin.store.records.get(agent), batched.admin.store.records.get(agent)
        assert a is not None and b is not None and a.token_ids == b.token_ids and a.blocks == b.blocks
        for h in a.blocks:
            worst = max(
                worst,
                _kv_mismatch(
                    batched,
                    alone.admin.store.blocks.get(h).tensors,
                    batched.admin.store.blocks.get(h).tensors,
                ),
            )
    # Float sums in another order (a batch of 3 rows, prefill chunks of another size) may move
    # a value across a rounding boundary: one 16-bit ulp, or one 4/6-bit quantization step.
    assert worst <= 0.002, worst
    figures[f"batched vs alone ({model}, {attention})"] = (
        f"{len(PROMPTS)} agents, greedy text identical, {worst:.3%} of stored K/V values differ (rounding)"
    )


def _kv_mismatch(engine: Engine, a: dict[str, mx.array], b: dict[str, mx.array]) -> float:
    """The fraction of K/V values (dequantized) that differ by more than 1 % of their scale."""
    assert a.keys() == b.keys()
    differ = total = 0
    for name in a:
        layer, kv, part = name.split(".")
        if part in ("scales", "biases"):
            continue
        if part == "q":
            codec = engine.quant.keys if kv == "k" else engine.quant.values
            parts = [f"{layer}.{kv}.{p}" for p in ("q", "scales", "biases")]
            x = codec.decode(tuple(a[n] for n in parts), mx.float32)
            y = codec.decode(tuple(b[n] for n in parts), mx.float32)
        else:
            x, y = a[name].astype(mx.float32), b[name].astype(mx.float32)
        scale = mx.abs(x).mean().item()
        differ += (mx.abs(x - y) > 0.01 * scale).sum().item()
        total += x.size
    return differ / total


def test_a_turn_of_a_busy_agent_waits_for_its_previous_turn(smollm: object, tmp_path: Path) -> None:
    """Two requests for one agent at once run one after the other: the second extends the
    cache the first committed."""
    engine = Engine("smollm2-135m", cache_dir=tmp_path)
    first = PROMPTS["lawyer"]
    results: dict[str, GenerationResult] = {}

    def run(name: str, prompt: str) -> None:
        results[name] = engine.generate("lawyer", prompt, GREEDY)

    one = threading.Thread(target=run, args=("first", first))
    one.start()
    # Force the race: the second turn arrives while the first is admitted and running.
    while not any(r.agent_id == "lawyer" for r in engine._scheduler.active):
        time.sleep(0.001)
    two = threading.Thread(target=run, args=("second", first + " The Apache License.\nQ: Who wrote it?\nA:"))
    two.start()
    one.join()
    two.join()
    # Had it run at once it would have found no cache (the first had not committed yet).
    assert str(results["first"].outcome) == "cold"
    assert str(results["second"].outcome).startswith("hot-")  # the first turn's cache, in memory
    assert results["second"].reused_tokens >= results["first"].prompt_tokens - 1


class FanOut(TypedDict):
    question: str
    answers: Annotated[list[tuple[str, str]], operator.add]


BRANCHES = {
    "lawyer": "You answer questions about this license.\n\n" + corpus.apache_license()[:700],
    "tutor": "You teach Python.\n\n" + corpus.python_docs_topic("while")[:700],
    "critic": "You review Python code.\n\n" + corpus.python_docs_topic("lambda")[:700],
}


def test_langgraph_fan_out_branches_run_concurrently(
    smollm: object, tmp_path: Path, figures: dict[str, str]
) -> None:
    """Three parallel branches, each calling ChatAgentMemory: LangGraph runs them on threads,
    the engine runs them together (their decode steps batched), each answers as it would
    alone."""
    from langgraph.graph import END, START, StateGraph

    llm = ChatAgentMemory(cache_dir=str(tmp_path / "together"), max_tokens=16)

    def branch(name: str):  # type: ignore[no-untyped-def]
        def run(state: FanOut) -> dict:
            reply = llm.invoke([SystemMessage(BRANCHES[name]), HumanMessage(state["question"])])
            return {"answers": [(name, reply.content)]}

        return run

    g = StateGraph(FanOut)
    for name in BRANCHES:
        g.add_node(name, branch(name))
        g.add_edge(START, name)
        g.add_edge(name, END)
    app = g.compile()
    out = app.invoke(
        {"question": "Say what you do in one sentence.", "answers": []}, {"configurable": {"thread_id": "t"}}
    )
    together = dict(out["answers"])
    assert llm.engine.stats()["max_decode_batch"] >= 2

    alone = ChatAgentMemory(cache_dir=str(tmp_path / "alone"), max_tokens=16)
    for name, system in BRANCHES.items():
        reply = alone.invoke([SystemMessage(system), HumanMessage("Say what you do in one sentence.")])
        assert together[name] == reply.content, name
    figures["LangGraph fan-out"] = (
        f"{len(BRANCHES)} branches, decode batch up to {llm.engine.stats()['max_decode_batch']}, "
        "answers identical to each branch alone"
    )


@pytest.mark.parametrize("policy", ["interleave", "fcfs"])
def test_a_warm_agent_does_not_wait_for_a_cold_prefill(smollm: object, tmp_path: Path, policy: str) -> None:
    """B (a warm cache, a few new tokens) arrives while A's long cold prefill runs: under the
    engine's policy B's first token comes first; first-come-first-served makes it wait.
    A's prefill runs in 32-token chunks (~50 of them): B arrives while most of it is left
    however slow the machine is, rather than in its last chunk (where both finish at once)."""
    engine = Engine("smollm2-135m", cache_dir=tmp_path, scheduling=policy, chunk_tokens=32)
    history = PROMPTS["lawyer"]
    engine.generate("b", history, GenerationParams(max_tokens=2))
    long_prompt = "Read this.\n\n" + corpus.apache_license()[:7000] + "\nQ: Its name?\nA:"
    order: list[str] = []

    def first_token(agent: str, prompt: str) -> None:
        for _ in engine.stream(agent, prompt, GenerationParams(max_tokens=2)):
            order.append(agent)
            break

    a = threading.Thread(target=first_token, args=("a", long_prompt))
    a.start()
    while not any(getattr(r, "prefilled", 0) for r in engine._scheduler.active):  # A's prefill has begun
        threading.Event().wait(0.01)
    first_token("b", engine.admin.cached_text("b") + "\nQ: And who wrote it?\nA:")
    a.join()
    assert order == (["b", "a"] if policy == "interleave" else ["a", "b"])


def test_fan_out_prefills_the_shared_prefix_once(smollm: Any, tmp_path: Path, together: Any) -> None:
    """Four agents released at once with prompts that share a ~300-token prefix: one
    prefills it, the others start from copies of its caches (``hot-shared``), and every
    answer equals the one that agent gets alone, cold (16-bit KV)."""
    prefix = "You answer questions about this license.\n\n" + corpus.apache_license()[:1200]
    questions = ["Its name?", "Who wrote it?", "Can I sell copies?", "Is there a warranty?"]
    prompts = {f"item-{i}": f"{prefix}\n\nQ: {q}\nA:" for i, q in enumerate(questions)}
    params = GenerationParams(max_tokens=8)
    expected = {
        agent: Engine("smollm2-135m", cache_dir=tmp_path / f"alone-{agent}", kv_bits=None).generate(
            agent, prompt, params
        )
        for agent, prompt in prompts.items()
    }
    engine = Engine("smollm2-135m", cache_dir=tmp_path / "fan-out", kv_bits=None)
    got = together(engine, prompts, params)
    outcomes = sorted(str(r.outcome) for r in got.values())
    assert outcomes == ["cold", "hot-shared", "hot-shared", "hot-shared"], outcomes
    for agent, result in got.items():
        assert result.text == expected[agent].text, agent
        if str(result.outcome) == "hot-shared":
            assert result.reused_tokens >= 256
    assert engine.stats()["max_decode_batch"] >= 2
    # What each agent stored stands for its own prompt and reply: a reload extends it.
    for agent, prompt in prompts.items():
        engine.admin.drop_hot(agent)
        again = engine.generate(agent, prompt + got[agent].text + "\nQ: Thanks.\nA:", params)
        assert again.outcome.match.value == "extend"


def test_fan_out_over_a_stored_prompt_decodes_it_once_and_forks_the_rest(
    smollm: Any, tmp_path: Path, together: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four new agents released at once whose prompts start with a system prompt another
    agent stored and run on past its whole blocks: the stored blocks are decoded to full
    precision once between them (not once each), the part past the blocks is run once and
    forked, and each answer equals the one that agent gets alone on the same stored prompt
    (16-bit KV)."""
    from langchain_agent_memory.engine.kv import batch, layer_work
    from langchain_agent_memory.engine.storage.blocks import BLOCK_TOKENS

    prefix = "You answer questions about this license.\n\n" + corpus.apache_license()[:2400]
    questions = ["Its name?", "Who wrote it?", "Can I sell copies?", "Is there a warranty?"]
    prompts = {f"item {i}": f"{prefix}\n\nQ: {q}\nA:" for i, q in enumerate(questions)}
    params = GenerationParams(max_tokens=8)

    def stored_prompt(name: str) -> Engine:
        engine = Engine("smollm2-135m", cache_dir=tmp_path / name, kv_bits=None)
        # Its prompt parts from theirs well before theirs part from each other: what they
        # read of it (its whole blocks and its next block's leading rows, ``prefix_index``)
        # ends there, and the run of the prefix past it is theirs to share.
        engine.generate("first", f"{prefix[:1400]}\n\nSummarize this.", params)
        return engine

    alone = stored_prompt("alone")
    expected = {agent: alone.generate(agent, prompt, params) for agent, prompt in prompts.items()}
    assert {str(r.outcome) for r in expected.values()} == {"hot-shared"}
    stored = min(r.reused_tokens for r in expected.values())  # what they read of "first"
    assert stored >= BLOCK_TOKENS

    decodes: list[int] = []
    decode = layer_work.decode_segments

    def counted(segments: Any, rows: int, *args: Any) -> Any:
        if sum(seg[0][0].shape[2] for seg in segments) >= stored:
            decodes.append(rows)
        return decode(segments, rows, *args)

    once: list[int] = []  # decode steps whose members read the stored prompt once between them
    over_prefix = batch.attention_over_decoded_prefix

    def counted_steps(queries: mx.array, prefix_k: mx.array, *args: Any) -> mx.array:
        once.append(prefix_k.shape[2])
        return over_prefix(queries, prefix_k, *args)

    engine = stored_prompt("fan-out")
    layers = len(engine.agents.new_layers())
    monkeypatch.setattr(layer_work, "decode_segments", counted)
    monkeypatch.setattr(batch, "attention_over_decoded_prefix", counted_steps)
    got = together(engine, prompts, params)
    for agent, result in got.items():
        assert str(result.outcome) == "hot-shared", (agent, result.outcome)
        assert result.text == expected[agent].text, agent
    assert len(decodes) <= 2 * layers < len(prompts) * layers, len(decodes)  # not once per agent
    # Batched decode steps read the stored prompt's rows once for all members, every layer.
    assert engine.stats()["max_decode_batch"] >= 2
    assert len(once) >= layers and min(once) >= stored, (len(once), min(once, default=0))
    forked = [r for r in got.values() if r.reused_tokens > stored]
    assert len(forked) >= len(prompts) - 1, [r.reused_tokens for r in got.values()]


def test_fan_out_siblings_next_turns_equal_their_reload(smollm: Any, tmp_path: Path, together: Any) -> None:
    """After a fan-out over a stored prompt (the default 4-bit-class format), each
    sibling's next turn from the copy it kept in memory (its turn's rows replaced by what
    the stored form decodes to, joined to the prompt's one decode where next read) equals
    the same turn read back from disk by a new engine."""
    prefix = "You answer questions about this license.\n\n" + corpus.apache_license()[:2400]
    questions = ["Its name?", "Who wrote it?", "Can I sell copies?"]
    prompts = {f"sibling {i}": f"{prefix}\n\nQ: {q}\nA:" for i, q in enumerate(questions)}
    params = GenerationParams(max_tokens=8)
    engine = Engine("smollm2-135m", cache_dir=tmp_path / "fan-out", kv_bits=4)
    engine.generate("first", f"{prefix}\n\nQ: Which license is this?\nA:", params)
    got = together(engine, prompts, params)
    assert {str(r.outcome) for r in got.values()} == {"hot-shared"}
    assert engine.stats()["max_decode_batch"] >= 2
    engine.flush()
    shutil.copytree(tmp_path / "fan-out", tmp_path / "reread")
    follow = {agent: f"{prompts[agent]}{got[agent].text}\nQ: Why?\nA:" for agent in prompts}
    hot = {agent: engine.generate(agent, prompt, params) for agent, prompt in follow.items()}
    reread = Engine("smollm2-135m", cache_dir=tmp_path / "reread", kv_bits=4)
    for agent, prompt in follow.items():
        warm = reread.generate(agent, prompt, params)
        assert str(hot[agent].outcome).startswith("hot-"), hot[agent].outcome
        assert str(warm.outcome).startswith("warm-"), warm.outcome
        assert (hot[agent].text, hot[agent].reused_tokens) == (warm.text, warm.reused_tokens), agent


@pytest.mark.parametrize("attention", ["copy", "stored"])
def test_short_turns_of_several_agents_prefill_in_one_pass_as_each_alone(
    attention: str,
    smollm: Any,
    tmp_path: Path,
    together: Any,
    monkeypatch: pytest.MonkeyPatch,
    figures: dict[str, str],
) -> None:
    """Three hot agents get follow-ups of different lengths at once: their new tokens run
    in one batched forward pass (the shorter padded on the right, the padding taken out of
    their caches after it), and each reply and stored cache equals the agent's alone."""
    from langchain_agent_memory.engine.requests.runner import ModelRunner

    passes: list[list[int]] = []
    whole = ModelRunner.prefill_whole
    monkeypatch.setattr(
        ModelRunner,
        "prefill_whole",
        lambda self, items: passes.append([len(ids) for ids, _ in items]) or whole(self, items),
    )
    follow = {
        "lawyer": "\nQ: And who wrote it?\nA:",
        "tutor": "\nQ: Why?\nA:",
        "poet": "\nNow one more line, please, about the moon.\n",
    }
    alone = Engine("smollm2-135m", cache_dir=tmp_path / "alone", kv_bits=None, attention=attention)
    batched = Engine("smollm2-135m", cache_dir=tmp_path / "batched", kv_bits=None, attention=attention)
    for engine in (alone, batched):
        for agent, prompt in PROMPTS.items():
            engine.generate(agent, prompt, GREEDY)
    expected = {
        agent: alone.generate(agent, alone.admin.cached_text(agent) + follow[agent], GREEDY)
        for agent in PROMPTS
    }
    passes.clear()
    got = together(
        batched, {agent: batched.admin.cached_text(agent) + follow[agent] for agent in PROMPTS}, GREEDY
    )
    assert any(len(lens) >= 2 and len(set(lens)) >= 2 for lens in passes), passes  # one pass, unequal tails
    for agent in PROMPTS:
        assert str(got[agent].outcome) == "hot-extend", got[agent].outcome
        assert got[agent].text == expected[agent].text, agent
        a, b = alone.admin.store.records.get(agent), batched.admin.store.records.get(agent)
        assert a is not None and b is not None and a.token_ids == b.token_ids
    figures[f"short turns in one prefill pass ({attention})"] = (
        f"tails of {passes[0]} tokens in one pass, replies identical to each alone"
    )


def test_seeded_sampling_in_a_batch_equals_each_alone(smollm: Any, tmp_path: Path, together: Any) -> None:
    """Sampled and greedy requests decoding together, one step ahead (each draw fed before
    it is read): a seeded request's text equals the one it samples alone with each draw read
    before the next step (its draws use its own (seed, step) keys, whatever the batch), and
    a greedy one's equals greedy alone."""
    params = {
        "lawyer": GenerationParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=3),
        "tutor": GenerationParams(max_tokens=12, temperature=1.0, top_k=20, seed=5),
        "poet": GREEDY,
    }
    alone = Engine("smollm2-135m", cache_dir=tmp_path / "alone", kv_bits=None)
    alone._steps.decode_ahead = False  # the oracle reads each draw before the next step
    expected = {agent: alone.generate(agent, PROMPTS[agent], params[agent]).text for agent in PROMPTS}
    batched = Engine("smollm2-135m", cache_dir=tmp_path / "batched", kv_bits=None)
    got = together(batched, PROMPTS, params)
    assert batched.stats()["max_decode_batch"] >= 2
    assert {agent: r.text for agent, r in got.items()} == expected


def test_repeat_penalties_equal_mlx_lm_and_batched_equals_alone(
    smollm: Any, tmp_path: Path, together: Any
) -> None:
    """A repetition penalty (small models loop without one) picks the tokens mlx-lm's own
    logits processors pick (greedy, the same prompt), changes what greedy decoding says, and
    several agents decoding together with penalties each say what they say alone."""
    from mlx_lm import generate
    from mlx_lm.sample_utils import make_logits_processors, make_sampler

    engine = Engine("smollm2-135m", cache_dir=tmp_path / "a", kv_bits=None)
    tok = engine.tokenizer

    def chat(text: str) -> str:
        return tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )

    prompt = chat("Write the word cat many times.")
    penal = GenerationParams(max_tokens=20, repetition_penalty=1.3, exact_text=True)
    ours = engine.generate("pen", prompt, penal).text
    processors = make_logits_processors(repetition_penalty=1.3, repetition_context_size=20)
    theirs = generate(
        engine.lm.model,
        tok,
        prompt,
        max_tokens=20,
        sampler=make_sampler(temp=0.0),
        logits_processors=processors,
    )
    assert ours == theirs
    plain = engine.generate("plain", prompt, GenerationParams(max_tokens=20, exact_text=True)).text
    assert plain != ours  # the penalty was applied
    prompts = {f"p{i}": chat(q) for i, q in enumerate(["Count to twenty.", "Name many fruits.", "Say hi."])}
    mixed = {"p0": penal, "p1": GenerationParams(max_tokens=20, presence_penalty=0.8, frequency_penalty=0.4),
             "p2": GenerationParams(max_tokens=20)}  # fmt: skip
    alone_engine = Engine("smollm2-135m", cache_dir=tmp_path / "b", kv_bits=None)
    alone = {a: alone_engine.generate(a, p, mixed[a]).text for a, p in prompts.items()}
    both = together(engine, prompts, mixed)
    assert {a: r.text for a, r in both.items()} == alone


def test_the_gpu_kernel_warm_up_joins_filters_and_dissolves_a_stored_batch(
    smollm: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """What an engine runs at start on a GPU (``ModelRunner.warm_up``: throwaway caches, so
    that mlx compiles a first turn's kernels before a request waits), run here on the CPU
    over the stored form: a batch forms, a member joins it and one leaves it with the others
    kept, and nothing is left behind; the engine then serves as before."""
    from langchain_agent_memory.engine.requests.runner import ModelRunner

    engine = Engine("smollm2-135m", cache_dir=tmp_path, attention="stored")
    runner = ModelRunner(engine.lm.model, engine.lm.batches)
    sizes: list[int] = []
    leave = runner.leave
    runner.leave = lambda *keys: sizes.append(len(runner._members)) or leave(*keys)  # type: ignore[method-assign]
    with caplog.at_level("WARNING"):
        engine._worker.call(runner.warm_up, engine.agents.new_layers, engine.tokenizer)
    assert "warm-up" not in caplog.text, caplog.text
    assert sizes == [3] and runner._caches is None and not runner._members
    reply = engine.generate("after", PROMPTS["lawyer"], GREEDY)
    assert reply.text and str(reply.outcome).startswith("cold")
    engine.close()
