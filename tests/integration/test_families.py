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
one row's: 3 of 9 families drift within 8 tokens at bf16, none at float32)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from langchain_agent_memory import corpus
from langchain_agent_memory.engine.engine import Engine, GenerationParams
from langchain_agent_memory.engine.model.families import UnsupportedModelError
from langchain_agent_memory.engine.model.loading import LoadedModel, resolve_model_dir
from langchain_agent_memory.engine.ops import device
from langchain_agent_memory.engine.prefix import MatchKind
from langchain_agent_memory.testing.random_model import SMALL_CONFIGS, WIDTH_CONFIGS, write_random_model

pytestmark = pytest.mark.gpu

#: SmolLM2's real weights: on a GPU only (on the CPU tests/integration/test_engine.py has them).
REAL = "smollm2-real"
FAMILIES = sorted(SMALL_CONFIGS) + ([REAL] if device.on_gpu() else [])
#: Weights of the reload / DIVERGE / 4-bit oracles, and of batched == alone (see above).
WEIGHTS = device.weight_dtype()
BATCH_WEIGHTS = "float32"
GREEDY = GenerationParams(max_tokens=8)
# ~300 tokens: more than one 256-token block, and past the small configs' 48-token windows.
SYSTEM = corpus.apache_license()[:1500]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, smollm: LoadedModel) -> Callable[[str, str], Path]:
    """A family's model directory at a weight dtype (built once per module)."""
    root = tmp_path_factory.mktemp("families")
    built: dict[tuple[str, str], Path] = {}

    def get(family: str, dtype: str = WEIGHTS) -> Path:
        if (family, dtype) not in built:
            if family == REAL:
                built[family, dtype] = resolve_model_dir("smollm2-135m", weight_dtype=dtype)[0]
            else:
                out = root / f"{family}-{dtype}"
                config = {**SMALL_CONFIGS, **WIDTH_CONFIGS}[family]
                built[family, dtype] = write_random_model(config, out, smollm.path, seed=7, dtype=dtype)
        return built[family, dtype]

    return get


#: How requests attend: on the stored form (``kv.stored``), over a full-precision working
#: copy through the engine's attention (the default: the CPU kernels there, mlx's fused one
#: on a GPU), or mlx-lm's own attention code on the arrays the caches return.
PATHS = ["stored", "copy", "mlx-attention"]


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
@pytest.mark.parametrize("family", FAMILIES + sorted(WIDTH_CONFIGS))
def test_default_4bit_format_reloads_like_the_hot_run(
    family: str, attention: str, model_dir: Callable[[str, str], Path], tmp_path: Path
) -> None:
    if family == "gpt_oss" and device.on_gpu():
        # Open (issue 18): on the H200 (bf16) the reloaded 4-bit cache of the random gpt-oss
        # drifts from the hot run within 8 tokens; the 16-bit reload is exact there.
        pytest.xfail("gpt-oss 4-bit reload != hot on a GPU: under investigation")
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
    record = again.store.get_agent("x")
    assert record is not None and len(record.blocks) >= 2  # persisted in 256-token blocks
    stored = again.cached_text("x")
    exact = again.generate("x", stored, GREEDY)
    n = len(record.token_ids)  # the last token is re-run (back to a whole character)
    assert exact.outcome.match is MatchKind.EXACT and n - 8 <= exact.reused_tokens <= n - 1
    extend = again.generate("x", again.cached_text("x") + " More:", GREEDY)
    assert extend.outcome.match is MatchKind.EXTEND


PROMPTS = {
    "lawyer": SYSTEM[:1100] + "\n\nQ: Its name?\nA:",
    "tutor": "You teach Python.\n\n" + corpus.python_docs_topic("while")[:600] + "\n\nQ: while?\nA:",
    "poet": "Write a short poem about the sea.\n",
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("family", FAMILIES)
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


@pytest.mark.parametrize("family", ["qwen3_next", "lfm2", "nemotron_h", "starcoder2", "bert"])
def test_an_unsupported_family_is_refused_when_the_engine_is_built(family: str, tmp_path: Path) -> None:
    model = _config_dir(tmp_path, family)
    with pytest.raises(UnsupportedModelError, match=f"{family}.*Supported families: deepseek_v2") as info:
        Engine(model, cache_dir=tmp_path / "kv")
    assert ("recurrent state" in str(info.value)) is (family in {"qwen3_next", "lfm2", "nemotron_h"})
