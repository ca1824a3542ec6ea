"""The persistent KV engine on the real default model, real files: reload equals the
uninterrupted run, prefix matching, shared blocks, restarts, corruption, bad input."""

from __future__ import annotations

import json
import logging
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from langchain_agent_memory import corpus
from langchain_agent_memory.engine.caches.block_cuts import block_of, run_of
from langchain_agent_memory.engine.engine import (
    ContextLengthError,
    Engine,
    GenerationParams,
    GenerationResult,
)
from langchain_agent_memory.engine.model.loading import LoadedModel
from langchain_agent_memory.engine.ops.runtime import mx
from langchain_agent_memory.engine.prefix import MatchKind
from langchain_agent_memory.engine.storage.blocks import (
    BLOCK_TOKENS,
    SEGMENTS_FORMAT_VERSION,
    AgentRecord,
    CacheFormatError,
    freeze_blocks,
)

GREEDY = GenerationParams(max_tokens=10)


def _chat(engine: Engine, system: str, turns: list[tuple[str, str | None]]) -> str:
    messages = [{"role": "system", "content": system}]
    for user, assistant in turns:
        messages.append({"role": "user", "content": user})
        if assistant is not None:
            messages.append({"role": "assistant", "content": assistant})
    return engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


SYSTEM = "You answer questions about this license.\n\n" + corpus.apache_license()[:1800]


def _two_turns(engine: Engine, agent: str, restart_dir: Path | None = None) -> tuple[str, str, object]:
    p1 = _chat(engine, SYSTEM, [("What is this license called?", None)])
    r1 = engine.generate(agent, p1, GREEDY)
    if restart_dir is not None:  # a new engine: new pool, nothing in memory
        engine = Engine("smollm2-135m", cache_dir=restart_dir, kv_format=engine.quant)
    p2 = _chat(engine, SYSTEM, [("What is this license called?", r1.text), ("Who wrote it?", None)])
    r2 = engine.generate(agent, p2, GREEDY)
    return r1.text, r2.text, r2


@pytest.mark.parametrize("kv_bits", [None, 4, 8])
def test_reload_gives_the_uninterrupted_output(
    smollm: LoadedModel, tmp_path: Path, kv_bits: int | None
) -> None:
    hot = Engine("smollm2-135m", cache_dir=tmp_path / "a", kv_bits=kv_bits)
    a1, a2, hot_r2 = _two_turns(hot, "agent")
    cold = Engine("smollm2-135m", cache_dir=tmp_path / "b", kv_bits=kv_bits)
    b1, b2, warm_r2 = _two_turns(cold, "agent", restart_dir=tmp_path / "b")
    assert (b1, b2) == (a1, a2)
    assert str(hot_r2.outcome) == "hot-extend" and str(warm_r2.outcome) == "warm-extend"
    assert warm_r2.reused_tokens == hot_r2.reused_tokens > 350
    assert warm_r2.prompt_tokens - warm_r2.reused_tokens < 40  # only the new turn was prefilled


def test_working_copies_stay_in_budget_and_answer_like_a_reload(smollm: LoadedModel, tmp_path: Path) -> None:
    eng = Engine("smollm2-135m", cache_dir=tmp_path)
    r1, r2, _ = _two_turns(eng, "a")
    one = eng.stats()["working_copy_bytes"]
    assert one > 0  # kept after the request, for the agent's next one
    eng.work_budget_bytes = one  # room for one agent's working copy
    _two_turns(eng, "b")  # the same conversation: the same size of working copy
    assert 0 < eng.stats()["working_copy_bytes"] <= one  # "a"'s was freed, "b"'s kept
    p3 = _chat(eng, SYSTEM, [("What is this license called?", r1), ("Who wrote it?", r2), ("Why?", None)])
    from_copy = eng.generate("b", p3, GREEDY)  # "b" attends over its working copy
    unpacked = eng.generate("a", p3, GREEDY)  # "a" unpacks its stored form
    # From disk ("a" holds p3 and its reply by now: the request trims back to p3).
    reloaded = Engine("smollm2-135m", cache_dir=tmp_path).generate("a", p3, GREEDY)
    assert str(from_copy.outcome) == str(unpacked.outcome) == "hot-extend"
    assert str(reloaded.outcome) == "warm-diverge"
    assert from_copy.text == unpacked.text == reloaded.text


def test_close_frees_the_engine_and_keeps_the_cache(smollm: LoadedModel, tmp_path: Path) -> None:
    import gc
    import weakref

    with Engine("smollm2-135m", cache_dir=tmp_path) as eng:
        prompt = _chat(eng, SYSTEM, [("What is this license called?", None)])
        first = eng.generate("a", prompt, GREEDY)
        assert eng.stats()["working_copy_bytes"] > 0
    with pytest.raises(RuntimeError, match="closed"):
        eng.generate("a", prompt, GREEDY)
    alive = weakref.ref(eng)
    del eng
    gc.collect()
    assert alive() is None  # its caches and working copies went with it
    again = Engine("smollm2-135m", cache_dir=tmp_path).generate("a", prompt, GREEDY)
    assert str(again.outcome) == "warm-diverge" and again.text == first.text


def test_close_right_after_a_reply_is_not_refused_but_one_during_a_reply_is(
    smollm: LoadedModel, tmp_path: Path
) -> None:
    """A finished save's result waiting in the loop's queue is no request in progress:
    close() right after a reply raised "requests are in progress" when the save thread had
    just posted it (the full-disk test failed so on a clean clone). A reply streaming is."""
    import time

    eng = Engine("smollm2-135m", cache_dir=tmp_path)
    stream = eng.stream("a", "Hello there.", GenerationParams(max_tokens=64))
    next(iter(stream))
    with pytest.raises(RuntimeError, match="in progress"):
        eng.close()
    for _ in stream:
        pass
    eng._worker.post(time.sleep, 0.3)  # a message queued for the loop, as a save's result is
    eng.close()


def test_exact_extend_diverge(smollm: LoadedModel, tmp_path: Path) -> None:
    eng = Engine("smollm2-135m", cache_dir=tmp_path, kv_bits=4)
    p = _chat(eng, SYSTEM, [("Summarise the license in one line.", None)])
    eng.generate("a", p, GREEDY)
    stored = eng.admin.cached_text("a")
    n = eng.admin.cached_tokens("a")
    assert stored.startswith(p) and len(stored) > len(p)

    exact = eng.generate("a", stored, GREEDY)
    assert exact.outcome.match is MatchKind.EXACT
    assert exact.reused_tokens == n - 1  # the last token is re-run for its logits

    stored = eng.admin.cached_text("a")
    n = eng.admin.cached_tokens("a")
    extend = eng.generate("a", stored + " And also", GREEDY)
    assert extend.outcome.match is MatchKind.EXTEND and extend.reused_tokens == n

    cut = len(p) // 2
    diverge = eng.generate("a", p[:cut] + " SOMETHING ELSE ENTIRELY", GREEDY)
    assert diverge.outcome.match is MatchKind.DIVERGE
    ids = eng.tokenizer.encode(p[:cut], add_special_tokens=False)
    assert abs(diverge.reused_tokens - len(ids)) <= 2  # up to the last boundary in the prefix


def test_stream_equals_generate_and_stop_sequences(smollm: LoadedModel, tmp_path: Path) -> None:
    eng = Engine("smollm2-135m", cache_dir=tmp_path, kv_bits=4)
    prompt = _chat(eng, "You are helpful.", [("Count from one to ten in words, separated by commas.", None)])
    full = eng.generate("s1", prompt, GenerationParams(max_tokens=24))
    chunks = list(eng.stream("s2", prompt, GenerationParams(max_tokens=24)))
    assert "".join(c.text for c in chunks) == full.text
    assert chunks[-1].result is not None and chunks[-1].result.text == full.text
    assert len(full.text) >= 8, full.text
    stop = full.text[len(full.text) // 2 :][:2]  # a stop sequence the model will produce
    expected = full.text[: full.text.find(stop)]
    stopped = eng.generate("s3", prompt, GenerationParams(max_tokens=24, stop=["NEVER-SEEN", stop]))
    assert stopped.finish_reason == "stop"
    assert stopped.text == expected
    streamed = "".join(c.text for c in eng.stream("s4", prompt, GenerationParams(max_tokens=24, stop=[stop])))
    assert streamed == expected  # text held back while it could still become the stop
    kept = eng.admin.cached_text("s3")[len(prompt) :]
    assert expected.startswith(kept) or kept.startswith(expected), (kept, expected)
    assert stop not in kept  # nothing past the stop is kept in the cache


def test_two_agents_store_a_shared_system_prompt_once(smollm: LoadedModel, tmp_path: Path) -> None:
    eng = Engine("smollm2-135m", cache_dir=tmp_path, kv_bits=4)
    system = "Use this text.\n\n" + corpus.python_docs()[:5000]  # > 1K tokens
    ra = eng.generate("a", _chat(eng, system, [("What is a for loop?", None)]), GREEDY)
    rb = eng.generate("b", _chat(eng, system, [("What does assert do?", None)]), GREEDY)
    chain_a = eng.admin.store.records.get("a").blocks  # type: ignore[union-attr]
    chain_b = eng.admin.store.records.get("b").blocks  # type: ignore[union-attr]
    shared = len(set(chain_a) & set(chain_b))
    assert shared >= 1000 // BLOCK_TOKENS
    files = list(eng.admin.store.blocks.dir.rglob("*.safetensors"))
    assert len(files) == len(set(chain_a) | set(chain_b))
    # The second agent wrote only its own tail blocks.
    assert rb.bytes_written < ra.bytes_written * (len(chain_b) - shared + 1) / len(chain_a)
    assert rb.reused_tokens >= shared * BLOCK_TOKENS  # and reused the shared prefix's KV


def test_a_new_session_reads_the_shared_instructions_up_to_its_own_text(
    smollm: LoadedModel, tmp_path: Path
) -> None:
    """Sessions of a harness begin with the same instructions, which end inside a block,
    where each session's own text begins: a second session reads the first one's keys and
    values up to there (the leading rows of the first one's next block), not only the whole
    blocks before it, and answers as a cold run of its prompt does (16-bit KV, greedy)."""
    eng = Engine("smollm2-135m", cache_dir=tmp_path, kv_bits=None)
    system = "Use this text.\n\n" + corpus.python_docs()[:2500]
    pa = _chat(eng, system, [("What is a for loop?", None)])
    pb = _chat(eng, system, [("What does assert do?", None)])
    eng.generate("a", pa, GREEDY)
    eng.flush()
    rb = eng.generate("b", pb, GREEDY)
    ids_a, ids_b = eng.tokenizer.encode(pa), eng.tokenizer.encode(pb)
    common = next(i for i, (x, y) in enumerate(zip(ids_a, ids_b, strict=False)) if x != y)
    assert common % BLOCK_TOKENS >= 32  # the instructions end inside a block
    assert rb.outcome.match is MatchKind.SHARED
    assert common - 8 <= rb.reused_tokens <= common, (rb.reused_tokens, common)
    cold = Engine("smollm2-135m", cache_dir=tmp_path / "cold", kv_bits=None).generate("b", pb, GREEDY)
    assert rb.text == cold.text


def test_a_session_in_a_new_process_reads_a_stored_session_up_to_its_own_text(
    smollm: LoadedModel, tmp_path: Path, figures: dict[str, str]
) -> None:
    """The same in a new process (a new engine on the same directory: nothing hot, nothing
    in memory): what the store holds says where the stored session's next block starts, so
    the new session reads its leading rows too, not only the whole blocks before them (the
    prefix index is filled from the records at open), and answers as a cold run does."""
    system = "Use this text.\n\n" + corpus.python_docs()[:2500]
    with Engine("smollm2-135m", cache_dir=tmp_path, kv_bits=None) as first:
        pa = _chat(first, system, [("What is a for loop?", None)])
        pb = _chat(first, system, [("What does assert do?", None)])
        first.generate("a", pa, GREEDY)
    with Engine("smollm2-135m", cache_dir=tmp_path, kv_bits=None) as eng:
        rb = eng.generate("b", pb, GREEDY)
        ids_a, ids_b = eng.tokenizer.encode(pa), eng.tokenizer.encode(pb)
    common = next(i for i, (x, y) in enumerate(zip(ids_a, ids_b, strict=False)) if x != y)
    whole = common // BLOCK_TOKENS * BLOCK_TOKENS
    assert common - whole >= 32  # the instructions end inside a block
    assert rb.outcome.match is MatchKind.SHARED
    assert whole < common - 8 <= rb.reused_tokens <= common, (rb.reused_tokens, whole, common)
    figures["a new process's session"] = (
        f"read {rb.reused_tokens} of the {common} tokens it shares with a stored session "
        f"({whole} in whole blocks), prefilled {rb.prompt_tokens - rb.reused_tokens} of {rb.prompt_tokens}"
    )
    with Engine("smollm2-135m", cache_dir=tmp_path / "cold", kv_bits=None) as cold_engine:
        cold = cold_engine.generate("b", pb, GREEDY)
    assert cold.reused_tokens == 0
    assert rb.text == cold.text


def test_restart_in_a_second_process(smollm: LoadedModel, tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import json, sys
        from langchain_agent_memory.engine.engine import Engine, GenerationParams, GenerationResult
        eng = Engine("smollm2-135m", cache_dir=sys.argv[1], kv_bits=4)
        r = eng.generate("agent", sys.argv[2], GenerationParams(max_tokens=10))
        print(json.dumps({"text": r.text, "outcome": str(r.outcome), "reused": r.reused_tokens}))
        """
    )
    eng = Engine("smollm2-135m", cache_dir=tmp_path / "mem", kv_bits=4)
    p1 = _chat(eng, SYSTEM, [("What is this license called?", None)])
    r1 = eng.generate("agent", p1, GREEDY)
    p2 = _chat(eng, SYSTEM, [("What is this license called?", r1.text), ("Is it free?", None)])
    uninterrupted = eng.generate("agent", p2, GREEDY)

    def run(prompt: str) -> dict:
        out = subprocess.run(
            [sys.executable, "-c", script, str(tmp_path / "disk"), prompt],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        return json.loads(out.stdout.strip().splitlines()[-1])

    first = run(p1)
    second = run(p2)
    assert first["outcome"] == "cold" and first["text"] == r1.text
    assert second["outcome"] == "warm-extend" and second["reused"] == uninterrupted.reused_tokens
    assert second["text"] == uninterrupted.text


def _stored_agent(tmp_path: Path) -> tuple[Engine, str, GenerationResult, AgentRecord]:
    """An engine whose agent "a" has a stored cache of two blocks."""
    eng = Engine("smollm2-135m", cache_dir=tmp_path, kv_bits=4)
    p = _chat(eng, SYSTEM, [("What is this license called?", None)])
    first = eng.generate("a", p, GREEDY)
    record = eng.admin.store.records.get("a")
    assert record is not None and len(record.blocks) == 2
    return eng, p, first, record


def test_newer_format_record_is_refused_not_overwritten(smollm: LoadedModel, tmp_path: Path) -> None:
    eng = Engine("smollm2-135m", cache_dir=tmp_path, kv_bits=4)
    p = _chat(eng, "Be brief.", [("Hi", None)])
    eng.generate("a", p, GenerationParams(max_tokens=2))
    index = sqlite3.connect(eng.admin.store.dir / "index.sqlite")
    (raw,) = index.execute("SELECT record FROM agents WHERE agent_id = 'a'").fetchone()
    newer = json.dumps({**json.loads(raw), "format_version": SEGMENTS_FORMAT_VERSION + 1})
    index.execute("UPDATE agents SET record = ? WHERE agent_id = 'a'", (newer,))
    index.commit()
    fresh = Engine("smollm2-135m", cache_dir=tmp_path, kv_bits=4)
    with pytest.raises(CacheFormatError, match="newer"):
        fresh.generate("a", p, GenerationParams(max_tokens=2))
    assert index.execute("SELECT record FROM agents WHERE agent_id = 'a'").fetchone() == (newer,)


@pytest.mark.parametrize("bad", ["", "../x", "a/../../b", "nul\x00id", "x" * 300])
def test_bad_agent_ids(smollm: LoadedModel, tmp_path: Path, bad: str) -> None:
    cache_dir = tmp_path / "cache"
    eng = Engine("smollm2-135m", cache_dir=cache_dir, kv_bits=4)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(ValueError, match="agent_id"):
        eng.generate(bad, "hello", GenerationParams(max_tokens=1))
    with pytest.raises(ValueError, match="agent_id"):
        eng.admin.set_agent(bad, AgentRecord("src", [], [], [], ""))
    # Refused before any work: no record, no block, no file anywhere (not "../x" either).
    assert list(eng.admin.store.records.list()) == [] and list(eng.admin.store.blocks.hashes()) == []
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_missing_block_falls_back_to_prefill(
    smollm: LoadedModel, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    eng, p, first, record = _stored_agent(tmp_path)
    eng.admin.store.blocks.path(record.blocks[-1]).unlink()
    fresh = Engine("smollm2-135m", cache_dir=tmp_path, kv_bits=4)
    with caplog.at_level(logging.WARNING):
        again = fresh.generate("a", p, GREEDY)
    assert any("missing" in r.message for r in caplog.records)
    # The agent's own chain is unusable, but the intact whole blocks before the missing one
    # are still found by content and reused.
    assert again.outcome.match is MatchKind.SHARED
    assert again.reused_tokens == BLOCK_TOKENS * (len(record.blocks) - 1)
    assert first.text and again.text
    repaired = fresh.admin.store.records.get("a")
    assert repaired is not None and all(fresh.admin.store.blocks.has(h) for h in repaired.blocks)


def test_sampling_is_reproducible_with_a_seed(smollm: LoadedModel, tmp_path: Path) -> None:
    eng = Engine("smollm2-135m", cache_dir=tmp_path, kv_bits=4)
    prompt = _chat(eng, "You are a storyteller.", [("Tell me a story about a fox.", None)])
    hot = GenerationParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=7)
    a = eng.generate("x", prompt, hot)
    b = eng.generate("y", prompt, hot)
    others = {eng.generate(f"z{s}", prompt, GenerationParams(max_tokens=16, temperature=1.0, seed=s)).text
              for s in range(3)}  # fmt: skip
    assert a.text == b.text
    assert len(others) > 1  # different seeds sample different continuations


async def test_async_stream_leaves_the_event_loop_free(smollm: LoadedModel, tmp_path: Path) -> None:
    import asyncio

    eng = Engine("smollm2-135m", cache_dir=tmp_path, kv_bits=4)
    prompt = _chat(eng, SYSTEM, [("What is this license called?", None)])
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.005)
            ticks += 1

    ticker = asyncio.create_task(tick())
    chunks = [c async for c in eng.astream("a", prompt, GREEDY)]
    ticker.cancel()
    # The loop kept running during the (> 1 s) prefill: MLX work is on the worker thread.
    assert ticks >= 20
    assert chunks[-1].result is not None
    assert "".join(c.text for c in chunks) == eng.generate("b", prompt, GREEDY).text


def test_closing_a_stream_early_cancels_and_keeps_what_was_generated(
    smollm: LoadedModel, tmp_path: Path
) -> None:
    eng = Engine("smollm2-135m", cache_dir=tmp_path, kv_bits=4)
    prompt = _chat(eng, "You are helpful.", [("Write a long poem about the sea.", None)])
    stream = eng.stream("a", prompt, GenerationParams(max_tokens=200))
    first = next(stream).text
    stream.close()
    # The next request queues behind the cancelled one, which commits first.
    again = eng.generate("a", eng.admin.cached_text("a"), GenerationParams(max_tokens=1))
    assert again.outcome.match is MatchKind.EXACT
    kept = eng.admin.cached_text("a")[len(prompt) :]
    assert kept.startswith(first.strip()[:3]) and eng.admin.cached_tokens("a") < again.prompt_tokens + 200


def test_requests_from_many_threads_equal_serial_ones(smollm: LoadedModel, tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    eng = Engine("smollm2-135m", cache_dir=tmp_path, kv_bits=4)
    prompts = [_chat(eng, "You are helpful.", [(q, None)]) for q in ("Name a fruit.", "Name a city.", "Hi!")]
    serial = [eng.generate(f"s{i}", p, GREEDY).text for i, p in enumerate(prompts)]
    with ThreadPoolExecutor(3) as pool:
        threaded = list(
            pool.map(lambda ip: eng.generate(f"t{ip[0]}", ip[1], GREEDY).text, enumerate(prompts))
        )
    assert threaded == serial


def test_context_length_refuses_long_prompts_and_ends_replies(smollm: LoadedModel, tmp_path: Path) -> None:
    assert Engine("smollm2-135m", cache_dir=tmp_path).context_length == 8192  # the model's trained context
    engine = Engine("smollm2-135m", cache_dir=tmp_path, context_length=64)
    prompt = _chat(engine, "Count.", [("Count from 1 to 300, separated by commas.", None)])
    n = len(engine.tokenizer.encode(prompt, add_special_tokens=False))
    assert 20 < n < 64
    r = engine.generate("counter", prompt, GenerationParams(max_tokens=200))
    assert r.finish_reason == "length" and r.prompt_tokens + r.completion_tokens == 64
    with pytest.raises(ContextLengthError, match="reads at most 64"):
        engine.generate("other", prompt + "1, 2, 3, " * 20, GREEDY)
    assert engine.admin.store.records.get("other") is None  # nothing was stored for the refused prompt


def test_the_working_copy_reserve_changes_no_output(
    smollm: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CPU engine reserves one agent's working-copy memory at its context length
    (``kv.reserve``); a warm restore that takes the reserved buffers answers token for token
    as one without them, and ``AGENT_MEMORY_RESERVE_WORK=0`` turns the reserve off."""
    from langchain_agent_memory.engine.kv.buffers import grown_rows

    outputs = []
    for setting in ("1", "0"):
        monkeypatch.setenv("AGENT_MEMORY_RESERVE_WORK", setting)
        eng = Engine("smollm2-135m", cache_dir=tmp_path / setting, kv_bits=4, context_length=1024)
        reserved = eng.agents.reserved_rows
        question = "What is this license called?"
        answer = eng.generate("a", _chat(eng, SYSTEM, [(question, None)]), GREEDY).text
        eng.flush()  # its blocks written (a save's blocks are served from memory until then)
        eng.admin.clear_memory()  # the next turn restores from the blocks
        prompt = _chat(eng, SYSTEM, [(question, answer), ("Who may use the work?", None)])
        second = eng.generate("a", prompt, GREEDY)
        assert str(second.outcome).startswith("warm") and second.completion_tokens > 3
        rows = {layer._work.k.shape[2] for layer in eng.agents.hot["a"].layers if layer._work is not None}
        if setting == "1" and mx.default_device() == mx.cpu:
            assert reserved == (grown_rows(1024),) * eng.spec.num_layers
            assert rows == {grown_rows(1024)}  # the agent (~500 tokens) took the reserved size
        else:
            assert reserved is None and rows and grown_rows(1024) not in rows
        outputs.append((second.text, second.completion_tokens))
        eng.close()
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("attention", ["copy", "stored"])
@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_blocks_cut_from_a_commits_run_hold_the_bytes_of_blocks_built_one_by_one(
    model: str, attention: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A commit builds its new blocks from one array per layer and part over the run of
    them (not an array per block): what a block file gets is the same bytes either way,
    sliding-window layers (Gemma 3) and the last, partial block included; served from the
    stored form, the run's arrays are views of the layers' own buffers."""
    request.getfixturevalue("smollm" if model.startswith("smollm") else "gemma")
    engine = Engine(model, cache_dir=tmp_path, attention=attention)
    engine.generate("a", corpus.python_docs()[:6000], GenerationParams(max_tokens=4))
    engine.flush()
    agents = engine.agents
    state = agents.hot["a"]
    assert state.layers is not None
    chain, known = state.blocks, state.tokens
    run = [b for b in range(1, len(chain)) if all(layer.start <= b * BLOCK_TOKENS for layer in state.layers)]
    assert len(run) >= 2  # whole blocks and the partial last one (Gemma: past its windows)

    def both() -> tuple[dict, list]:  # on the engine's worker: its arrays live on its stream
        ones = [block_of(agents.pool, b, chain, known, state.layers) for b in run]
        freeze_blocks(ones)
        return run_of(run, chain, known, state.layers), ones

    cut, ones = engine._worker.submit(both).result()
    for b, one in zip(run, ones, strict=True):
        got = cut[chain[b]]
        assert got.host is not None and one.host is not None
        assert got.host.keys() == one.host.keys() and got.token_ids == one.token_ids
        for name, tensor in one.host.items():
            mine = got.host[name].packed()
            assert (mine.dtype, mine.shape) == (tensor.dtype, tensor.shape), name
            assert mine.data.tobytes() == tensor.packed().data.tobytes(), name
        assert got.tensors.keys() == one.tensors.keys()
        # (the arrays themselves live on the engine's worker stream: compared through the
        # host bytes above, which is what is written)
        assert all(got.tensors[k].shape == one.tensors[k].shape for k in one.tensors)
    engine.close()


def test_agents_parked_after_decoding_together_hold_what_the_hot_tier_counts(tmp_path: Path) -> None:
    """Agents that decoded in one batch over a stored prompt, parked after three turns: the
    memory mlx holds beyond the weights is what the hot tier and the pool count, and nothing
    is in flight (the gauges an operator and the soak read). A leaver's working copy was a
    view of the batch's merged buffer, or a lazy join over one, which kept every member's
    rows and the room alive: in a soak, a worker's parked agents took up to ~1.5x what the
    tier counted (the view itself: ``test_batch_cache``)."""
    import threading

    engine = Engine("smollm2-135m", cache_dir=tmp_path)
    # One system prompt, stored: the members start from its blocks and decode them once,
    # together (a fan-out's way; ``DecodedPrefix``)
    system = "Answer in one short line.\n\n" + corpus.apache_license()[:1200]
    engine.generate("first", system, GenerationParams(max_tokens=2))
    engine.flush()
    engine.admin.clear_memory()
    mx.synchronize()
    before = mx.get_active_memory()
    texts = {f"agent-{i}": system + corpus.python_docs()[i * 300 : i * 300 + 200 * (i + 1)] for i in range(4)}

    def turn(agent: str, i: int, n: int) -> None:
        prompt = texts[agent] + f"\nQ: and point {n}?\nA:"
        texts[agent] = prompt + engine.generate(agent, prompt, GenerationParams(max_tokens=6 + 4 * i)).text

    for n in range(3):  # first turns, then turns that extend the parked copies
        threads = [threading.Thread(target=turn, args=(a, i, n)) for i, a in enumerate(texts)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        engine.flush()
    mx.synchronize()
    stats = engine.stats()
    assert stats["max_decode_batch"] >= 2, stats["max_decode_batch"]  # they decoded together
    assert stats["hot_tier"]["agents"] == len(texts)
    assert stats["turns"]["warm"] >= 2  # from the stored prompt
    counted = stats["hot_tier"]["bytes"] + stats["pool"]["hot_bytes"]
    held = mx.get_active_memory() - before
    assert stats["serving_bytes"] == 0 and stats["queued_save_bytes"] == 0
    assert held < 1.1 * counted, (held, counted)
    engine.close()


def test_a_save_in_flight_holds_no_copy_of_a_stored_form_agent(smollm: LoadedModel, tmp_path: Path) -> None:
    """Served from the stored form (a GPU's way), a turn's save reads its blocks' rows from
    the agent's own buffers while it waits to be written: memory while it waits is the
    agent's stored form, not twice it. A copy of the new rows stayed until the write (16
    agents of 8K tokens: 6 GB of an H100 beside the agents' own 6)."""
    import threading

    engine = Engine("smollm2-135m", cache_dir=tmp_path, attention="stored")
    engine.generate("warm-up", corpus.python_docs()[:800], GenerationParams(max_tokens=2))
    engine.flush()
    held_back = threading.Event()
    engine._save_queue.submit(held_back.wait, "a save ahead of the agent's")  # the writer is busy
    try:
        mx.synchronize()
        before = mx.get_active_memory()
        engine.generate("a", corpus.python_docs()[:6000], GenerationParams(max_tokens=2))
        mx.synchronize()
        waiting = mx.get_active_memory() - before
        state = engine.agents.hot["a"]
        assert state.layers is not None
        stored = sum(layer.nbytes for layer in state.layers)
        assert engine._save_queue.queued == 2  # the agent's save has not been written
    finally:
        held_back.set()
    engine.flush()
    assert waiting < 1.3 * stored, (waiting, stored)
    assert engine.generate("a", corpus.python_docs()[:6000] + " And?", GREEDY).outcome.source.value == "hot"
    engine.close()
