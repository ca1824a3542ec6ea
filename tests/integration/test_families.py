"""Every supported model family runs the whole engine (random weights, small configs built
here; tokenizer from SmolLM2): reload equals the uninterrupted run token for token at
16-bit KV, batched decode equals decode alone, a DIVERGE equals a cold run of the same
prompt, and the default 4-bit format persists and reloads. Each oracle runs on the CPU
kernels of an adapted model and on mlx-lm's own attention over the engine's caches (the
path a GPU takes). An unsupported family is refused when the engine is built.

On a GPU (``pytest -m gpu``, run by ``benchmarks/gpu.py`` on the H200) the same oracles run
on mlx's attention there, with SmolLM2's real weights beside the random ones. Tolerances
per device: models in their checkpoint dtype (float32 on the CPU, bfloat16 on a GPU, as
users run them) for reload, DIVERGE and the 4-bit format, all token for token; batched ==
alone at float32 weights on a GPU (a bf16 matmul of a 3-row batch rounds differently from
one row's: 3 of 9 families drift within 8 tokens at bf16, none at float32; float32 there
means TF32 off, ``MLX_ENABLE_TF32=0``, set in tests/conftest.py: mlx's CUDA default runs a
float32 matmul of several rows at TF32, and Qwen3-Next's near-tied router then flips)."""

from __future__ import annotations

import contextlib
import gc
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from langchain_agent_memory import corpus
from langchain_agent_memory.engine import resolve_model_dir
from langchain_agent_memory.engine.engine import Engine as _Engine
from langchain_agent_memory.engine.engine import GenerationParams
from langchain_agent_memory.engine.model.families import UnsupportedModelError
from langchain_agent_memory.engine.model.loading import LoadedModel, unload_models
from langchain_agent_memory.engine.ops import device
from langchain_agent_memory.engine.ops.runtime import mx
from langchain_agent_memory.engine.prefix import MatchKind
from langchain_agent_memory.testing.random_model import (
    HYBRID_CONFIGS,
    SMALL_CONFIGS,
    WIDTH_CONFIGS,
    write_random_model,
)

pytestmark = pytest.mark.gpu

#: SmolLM2's real weights: on a GPU only (on the CPU tests/integration/test_engine.py has them).
REAL = "smollm2-real"
#: Every family of mlx-lm runs the engine's default path in the model matrix
#: (test_model_matrix.py); here one family of each kind also takes the other paths (the
#: stored form, mlx-lm's own attention over the engine's caches), on a GPU every one.
FAMILIES = (
    [*sorted(SMALL_CONFIGS), REAL] if device.on_gpu() else ["deepseek_v2", "gemma3_text", "gpt_oss", "llama"]
)
#: Hybrid families (recurrent layers beside attention; ``kv.recurrent``): MoE ones run at
#: float32 only on this CPU build (mlx's CPU ``GatherMM``). Falcon-H1 keeps a recurrent
#: mixer and attention in one layer (mlx-lm's ``CacheList``): two slots of the engine's.
HYBRIDS = (
    sorted(HYBRID_CONFIGS) if device.on_gpu() else ["falcon_h1", "granitemoehybrid", "lfm2", "qwen3_next"]
)
#: Weights of the reload / DIVERGE / 4-bit oracles, and of batched == alone (see above).
WEIGHTS = device.weight_dtype()
BATCH_WEIGHTS = "float32"
GREEDY = GenerationParams(max_tokens=8)
# ~300 tokens: more than one 256-token block, and past the small configs' 48-token windows.
SYSTEM = corpus.apache_license()[:1500]


class Engine(_Engine):
    """The engine, each one a test makes closed after it (``_close_engines``): dozens of
    engines over random models would otherwise hold their memory for later modules."""

    made: ClassVar[list[_Engine]] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        Engine.made.append(self)


@pytest.fixture(autouse=True)
def _close_engines() -> Iterator[None]:
    yield
    while Engine.made:
        engine = Engine.made.pop()
        with contextlib.suppress(Exception):  # a test that closed it, or one that failed
            engine.close()


@pytest.fixture(scope="module")
def model_dir(
    tmp_path_factory: pytest.TempPathFactory, smollm: LoadedModel
) -> Iterator[Callable[[str, str], Path]]:
    """A family's model directory at a weight dtype (built once per module; the models
    loaded from them are let go at its end: later modules need the memory)."""
    root = tmp_path_factory.mktemp("families")
    built: dict[tuple[str, str], Path] = {}

    def get(family: str, dtype: str = WEIGHTS) -> Path:
        if (family, dtype) not in built:
            if family == REAL:
                built[family, dtype] = resolve_model_dir("smollm2-135m", weight_dtype=dtype)[0]
            else:
                out = root / f"{family}-{dtype}"
                config = {**SMALL_CONFIGS, **WIDTH_CONFIGS, **HYBRID_CONFIGS}[family]
                built[family, dtype] = write_random_model(config, out, smollm.path, seed=7, dtype=dtype)
        return built[family, dtype]

    yield get
    unload_models(root)
    gc.collect()
    mx.clear_cache()


#: How requests attend: on the stored form (``kv.stored``), over a full-precision working
#: copy through the engine's attention (the default: the CPU kernels there, mlx's fused one
#: on a GPU), or mlx-lm's own attention code on the arrays the caches return.
PATHS = ["stored", "copy", "mlx-attention"] if device.on_gpu() else ["stored", "mlx-attention"]


def _engine(model: Path, cache_dir: Path, kv_bits: int | None, path: str) -> Engine:
    attention = "stored" if path == "stored" else "copy"
    kernels = path != "mlx-attention"
    return Engine(model, cache_dir=cache_dir, kv_bits=kv_bits, attention=attention, cpu_kernels=kernels)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("family", FAMILIES)
def test_reload_and_diverge_equal_the_uninterrupted_and_cold_runs(
    family: str, path: str, model_dir: Callable[[str, str], Path], tmp_path: Path
) -> None:
    model = model_dir(family)
    # Uninterrupted: two turns on one engine (the second is hot).
    hot = _engine(model, tmp_path / "a", None, path)
    r1 = hot.generate("x", SYSTEM, GREEDY)
    p2 = SYSTEM + r1.text + "\n\nQ: and the second part?\nA:"
    r2 = hot.generate("x", p2, GREEDY)
    # Interrupted: turn 1, then a new engine (new pool, nothing in memory) reads it back.
    _engine(model, tmp_path / "b", None, path).generate("x", SYSTEM, GREEDY)
    warm = _engine(model, tmp_path / "b", None, path).generate("x", p2, GREEDY)
    assert warm.outcome.source.value == "warm"  # read from disk
    assert warm.reused_tokens == r2.reused_tokens > 250
    assert warm.text == r2.text and r2.completion_tokens > 0

    # DIVERGE: the stored conversation cut in the middle of the document, then new text.
    p3 = SYSTEM[:900] + " -- a different question entirely: what is a patent?"
    diverge = hot.generate("x", p3, GREEDY)
    assert diverge.outcome.match is MatchKind.DIVERGE and diverge.reused_tokens > 150
    cold = _engine(model, tmp_path / "c", None, path).generate("y", p3, GREEDY)
    assert str(cold.outcome) == "cold"
    assert diverge.text == cold.text


@pytest.mark.parametrize("attention", ["stored", "copy"])
@pytest.mark.parametrize("family", FAMILIES + sorted(WIDTH_CONFIGS) + HYBRIDS)
def test_default_4bit_format_reloads_like_the_hot_run(
    family: str, attention: str, model_dir: Callable[[str, str], Path], tmp_path: Path
) -> None:
    drifts = family in ("gpt_oss", "kimi_linear") or (family, attention) == ("lfm2_moe", "stored")
    if drifts and device.on_gpu():
        # Open (issues 18, 40): on the H200 (bf16) the reloaded 4-bit cache of these random
        # mixture-of-experts models drifts from the hot run; their 16-bit reload is exact
        # there, and on the CPU (float32) the 4-bit one is too.
        pytest.xfail(f"{family} 4-bit reload != hot on a GPU (bf16 MoE): under investigation")
    model = model_dir(family)
    hot = Engine(model, cache_dir=tmp_path / "a", attention=attention)
    r1 = hot.generate("x", SYSTEM, GREEDY)
    p2 = SYSTEM + r1.text + " Next:"
    r2 = hot.generate("x", p2, GREEDY)
    Engine(model, cache_dir=tmp_path / "b", attention=attention).generate("x", SYSTEM, GREEDY)
    again = Engine(model, cache_dir=tmp_path / "b", attention=attention)
    warm = again.generate("x", p2, GREEDY)
    assert str(warm.outcome).startswith("warm") and warm.text == r2.text
    assert again.quant.label == hot.quant.label == "k6g64h-v4g64h-h4"
    record = again.admin.store.records.get("x")
    assert record is not None and len(record.blocks) >= 2  # persisted in 256-token blocks
    stored = again.admin.cached_text("x")
    exact = again.generate("x", stored, GREEDY)
    n = len(record.token_ids)  # the last token is re-run (back to a whole character)
    assert exact.outcome.match is MatchKind.EXACT and n - 8 <= exact.reused_tokens <= n - 1
    extend = again.generate("x", again.admin.cached_text("x") + " More:", GREEDY)
    assert extend.outcome.match is MatchKind.EXTEND


PROMPTS = {
    "lawyer": SYSTEM[:1100] + "\n\nQ: Its name?\nA:",
    "tutor": "You teach Python.\n\n" + corpus.python_docs_topic("while")[:600] + "\n\nQ: while?\nA:",
    "poet": "Write a short poem about the sea.\n",
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("family", FAMILIES + HYBRIDS)
def test_batched_decode_equals_decode_alone(
    family: str, path: str, model_dir: Callable[[str, str], Path], tmp_path: Path, together: Any
) -> None:
    model = model_dir(family, BATCH_WEIGHTS if device.on_gpu() else WEIGHTS)
    alone = _engine(model, tmp_path / "alone", None, path)
    expected = {agent: alone.generate(agent, p, GREEDY).text for agent, p in PROMPTS.items()}
    batched = _engine(model, tmp_path / "batched", None, path)
    got = together(batched, PROMPTS, GREEDY)
    assert batched.stats()["max_decode_batch"] >= 2  # the decodes did run together
    assert {a: r.text for a, r in got.items()} == expected


def _config_dir(tmp_path: Path, family: str) -> Path:
    out = tmp_path / family
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"model_type": family, "hidden_size": 64}))
    return out


@pytest.mark.parametrize("family", ["bert", "starcoder9"])
def test_a_family_mlx_lm_does_not_have_is_refused_when_the_engine_is_built(
    family: str, tmp_path: Path
) -> None:
    model = _config_dir(tmp_path, family)
    with pytest.raises(UnsupportedModelError, match=f"{family}.*is not one mlx-lm .* runs"):
        Engine(model, cache_dir=tmp_path / "kv")


#: ~620 tokens: two whole blocks (state snapshots at 256 and 512), then more.
LONG = corpus.apache_license()[:3000]


def _cut_at_token(engine: Engine, agent: str, n: int) -> str:
    """The stored text of ``agent`` up to the end of its ``n``-th token."""
    tokens = engine.admin.cached(agent)
    assert tokens.text
    return tokens.text[: tokens.ends[n - 1]]


@pytest.mark.parametrize("kv_bits", [None, 4])
@pytest.mark.parametrize("family", HYBRIDS)
def test_hybrid_reload_equals_the_uninterrupted_run_and_diverge_equals_cold(
    family: str, kv_bits: int | None, model_dir: Callable[[str, str], Path], tmp_path: Path
) -> None:
    """A hybrid agent reloaded from disk continues as the uninterrupted one (at 16-bit KV
    and in the default format: the state snapshots are stored exactly), and a DIVERGE at
    several points (on a snapshot, between two, before the first) equals a cold run."""
    model = model_dir(family, "float32")

    def engine(where: str) -> Engine:  # every snapshot the policy picks: 256 and 512 among them
        return Engine(model, cache_dir=tmp_path / where, kv_bits=kv_bits, state_budget=None)

    hot = engine("a")
    r1 = hot.generate("x", LONG, GREEDY)
    n1 = hot.admin.cached_tokens("x")
    p2 = hot.admin.cached_text("x") + "\n\nQ: and the second part?\nA:"
    r2 = hot.generate("x", p2, GREEDY)
    assert r2.outcome.match is MatchKind.EXTEND and r2.reused_tokens == n1  # the live state
    engine("b").generate("x", LONG, GREEDY)
    again = engine("b")
    warm = again.generate("x", p2, GREEDY)
    assert str(warm.outcome).startswith("warm") and warm.text == r2.text and r1.completion_tokens > 0
    assert warm.reused_tokens == n1 - 1  # the stored turn's end: its last token is re-run
    record = again.admin.store.records.get("x")
    assert (
        record is not None
        and record.states
        and len(record.blocks) == len(record.chain) + len(record.states) + len(record.priors)
    )

    # DIVERGE: on the 256-token snapshot, between 256 and 512, before the first snapshot;
    # each from an agent that started from x's blocks and snapshots (SHARED). Equal to cold
    # at 16-bit KV (a 4-bit format's reused keys are not the cold run's full-precision ones).
    for n, resumes in ((256, 256), (400, 256), (150, 0)) if kv_bits is None else ():
        agent = f"d{n}"
        shared = hot.generate(agent, LONG, GREEDY)
        assert shared.outcome.match is MatchKind.SHARED and shared.reused_tokens == 512
        prompt = _cut_at_token(hot, agent, n) + " -- a different question entirely: what is a patent?"
        diverge = hot.generate(agent, prompt, GREEDY)
        cold = engine(f"cold{n}").generate("y", prompt, GREEDY)
        assert str(cold.outcome) == "cold"
        assert diverge.text == cold.text, n
        assert diverge.reused_tokens == resumes, n


def test_a_hybrid_agents_snapshots_weigh_no_more_than_its_kv(
    model_dir: Callable[[str, str], Path], tmp_path: Path
) -> None:
    """In the default format an agent of ~5K tokens keeps no more snapshot bytes than its
    K/V's, so it takes at most twice its K/V on disk;
    a DIVERGE 1K tokens back still resumes from a snapshot; ``state_budget=None`` keeps
    every one the policy picks."""
    model = model_dir("qwen3_next", "float32")
    text = corpus.python_docs()[:20000]
    sizes = {}
    for budget in (1.0, None):
        engine = Engine(model, cache_dir=tmp_path / str(budget), state_budget=budget)
        engine.generate("x", text, GREEDY)
        engine.flush()
        record = engine.admin.store.records.get("x")
        assert record is not None and record.states
        chain, snaps = record.blocks[: len(record.chain)], record.blocks[len(record.chain) :]
        kv, states = (
            engine.admin.store.blocks.local_bytes(chain),
            engine.admin.store.blocks.local_bytes(snaps),
        )
        sizes[budget] = (len(snaps), kv, states)
        n = len(record.token_ids)
        cut = _cut_at_token(engine, "x", n - 1024)
        diverge = engine.generate("x", cut + " -- and now something else entirely?", GREEDY)
        assert diverge.outcome.match is MatchKind.DIVERGE and n - 1024 - 256 <= diverge.reused_tokens, budget
    (kept, kv, states), (every, _, all_states) = sizes[1.0], sizes[None]
    assert states <= kv, sizes
    assert every > kept and all_states > kv, sizes  # unbounded, the same agent weighs more


def test_a_disk_budget_evicts_hybrid_agents_with_their_snapshots(
    model_dir: Callable[[str, str], Path], tmp_path: Path
) -> None:
    """A byte budget over hybrid agents counts their snapshot blocks: after every save the
    cache directory is within it, an evicted agent's snapshots are deleted with its K/V
    blocks (none left on disk), and a kept agent resumes warm from its snapshot."""
    from langchain_agent_memory.engine.storage.budget import StorageBudget

    engine = Engine(model_dir("qwen3_next", "float32"), cache_dir=tmp_path)
    words = corpus.python_docs().split()

    def prompt(i: int) -> str:  # ~700 tokens of its own: two blocks and snapshots
        return f"Agent {i}: " + " ".join(words[i * 400 : i * 400 + 450])

    engine.generate("a0", prompt(0), GREEDY)
    engine.flush()
    budget = 3 * engine.admin.disk_bytes()
    engine.admin.storage_budget = StorageBudget(max_bytes=budget)
    snapshots: dict[str, list[str]] = {}
    for i in range(8):
        engine.generate(f"a{i}", prompt(i), GREEDY)
        engine.flush()
        record = engine.admin.store.records.get(f"a{i}")
        assert record is not None and record.states
        snapshots[f"a{i}"] = record.blocks[len(record.chain) :]
        assert engine.admin.disk_bytes() <= budget
        assert sum(p.stat().st_size for p in (tmp_path / "kv").rglob("*") if p.is_file()) <= budget
    evicted = [a for a in snapshots if not engine.admin.store.records.has(a)]
    assert evicted and "a7" not in evicted
    on_disk = set(engine.admin.store.blocks.hashes())
    assert not {h for a in evicted for h in snapshots[a]} & on_disk
    engine.admin.clear_memory()  # read from disk
    kept = engine.generate("a7", prompt(7) + " And then?", GREEDY)
    assert str(kept.outcome).startswith("warm") and kept.reused_tokens > 256
    engine.close()


@pytest.mark.parametrize("family", HYBRIDS)
def test_hybrid_fan_out_forks_at_a_block_boundary_and_equals_each_alone(
    family: str, model_dir: Callable[[str, str], Path], tmp_path: Path, together: Any
) -> None:
    """Three agents released at once with prompts that share ~620 tokens: the later ones
    start from the first one's recurrent state at the last block boundary it passed (a
    source in mid-prefill holds no other) and its K/V, and each answer equals the agent's
    alone, cold (16-bit KV)."""
    model = model_dir(family, "float32")
    prompts = {f"item-{i}": f"{LONG}\n\nQ: {q}\nA:" for i, q in enumerate(["Its name?", "Who?", "Sell?"])}
    expected = {
        agent: Engine(model, cache_dir=tmp_path / f"alone-{agent}", kv_bits=None).generate(agent, p, GREEDY)
        for agent, p in prompts.items()
    }
    engine = Engine(model, cache_dir=tmp_path / "fan-out", kv_bits=None)
    got = together(engine, prompts, GREEDY)
    assert sorted(str(r.outcome) for r in got.values()) == ["cold", "hot-shared", "hot-shared"]
    for agent, result in got.items():
        assert result.text == expected[agent].text, agent
        assert str(result.outcome) == "cold" or result.reused_tokens == 512
