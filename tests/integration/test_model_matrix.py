"""The model matrix, generated from the installed mlx-lm: every text family in its
``models/`` that a small config builds (``testing.family_configs``; random weights,
SmolLM2's tokenizer) runs the whole engine, each check an oracle (``testing.model_matrix``):
greedy text at 16-bit == mlx-lm's own ``generate_step``, reload == uninterrupted, DIVERGE
== cold, batched == alone, fan-out forks == alone, the default 4-bit format reloads. A
family the engine refuses says why (the layer and cache kind, or what the self-check
found). The recorded verdicts (``engine/model/family_verdicts.json``) and the docs' model
table are what this run found: ``python -m langchain_agent_memory.testing.model_matrix``
writes both. On a GPU (``pytest -m gpu``) the same matrix runs at bfloat16 weights
(``benchmarks/gpu.py`` runs it); the verdicts recorded are the CPU's."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import mlx.nn as mx_nn
import pytest
from mlx.utils import tree_flatten

from langchain_agent_memory.engine.model.families import recorded_verdicts
from langchain_agent_memory.engine.model.loading import LoadedModel, unload_models
from langchain_agent_memory.engine.ops import device
from langchain_agent_memory.testing import corpus
from langchain_agent_memory.testing.model_matrix import (
    CHECKS,
    GREEDY,
    FamilyReport,
    build,
    build_quantized,
    check_family,
    families,
    record,
    table,
)

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
FAMILIES = families()
#: ``MATRIX_SHARD=i/n``: the i-th of n slices of the families (1-based), for a run that must
#: fit a time limit per call (the GPU device's 10 minutes); the drift check then skips.
if shard := os.environ.get("MATRIX_SHARD"):
    i, n = (int(x) for x in shard.split("/"))
    FAMILIES = FAMILIES[i - 1 :: n]
#: The families users pick for local agents that must run (issue 52's list).
MUST_RUN = {
    "gemma3", "gemma4", "qwen3_moe", "qwen3_5_moe", "glm4_moe", "mistral3", "ministral3",
    "smollm3", "olmo3", "granite", "granitemoe", "mixtral", "qwen2_moe", "olmoe", "phimoe",
    "exaone4", "cohere2", "gemma2", "starcoder2", "llama4_text", "falcon_h1", "jamba", "olmo_hybrid",
}  # fmt: skip
MOST_REFUSED = 10
REPORTS: dict[str, FamilyReport] = {}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory, smollm: LoadedModel) -> Iterator[tuple[Path, Path]]:
    """Where the families' models and caches go, and the tokenizer they copy; the models
    loaded from there are let go at the module's end."""
    root = tmp_path_factory.mktemp("matrix")
    yield root, smollm.path
    unload_models(root)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_runs_the_engine_as_mlx_lm_does_or_is_refused_with_its_reason(
    family: str, workspace: tuple[Path, Path]
) -> None:
    root, tokenizer = workspace
    model = build(family, root / "models", tokenizer)
    report = check_family(family, model, root / "caches" / family)
    REPORTS[family] = report
    if report.verdict == "refused":
        assert family not in MUST_RUN, report.reason
        # What to do about it: the layer and its cache kind, or what the self-check found.
        assert re.search(r"layer \d+|differs from mlx-lm's own|mlx's CPU backend", report.reason), (
            report.reason
        )
        return
    assert report.failures == {}, report.failures
    assert set(report.checks) == set(CHECKS) and all(report.checks.values())


def _comparable(recorded: dict[str, object]) -> dict[str, object]:
    # What each family keeps and whether it runs; a reason's wording (an exception's text, a
    # logit error) may vary with the machine and the libraries' messages.
    families = recorded["families"]
    assert isinstance(families, dict)
    return {f: (row["verdict"], row["kinds"]) for f, row in families.items()}


def test_the_recorded_verdicts_and_the_docs_table_are_what_the_matrix_found() -> None:
    if device.on_gpu():
        pytest.skip("the verdicts recorded are the CPU's (float32 weights)")
    if set(REPORTS) != set(families()):
        pytest.skip("the whole matrix did not run in this session")
    found = record(REPORTS)
    runs = [f for f, row in found["families"].items() if row["verdict"] == "runs"]
    refused = [f for f, row in found["families"].items() if row["verdict"] == "refused"]
    assert len(runs) >= 45 and set(runs) >= MUST_RUN, sorted(MUST_RUN - set(runs))
    assert len(refused) <= MOST_REFUSED, refused
    recorded = recorded_verdicts()
    assert recorded["mlx_lm"] == found["mlx_lm"], (
        "run `python -m langchain_agent_memory.testing.model_matrix`"
    )
    assert _comparable(recorded) == _comparable(found), (
        "run `python -m langchain_agent_memory.testing.model_matrix`"
    )
    docs = (ROOT / "docs" / "models" / "families.md").read_text()
    assert docs == table(recorded), "the docs' table is generated: run the module above"


#: Checkpoints as mlx-community ships them: mlx-lm's own ``convert`` quantizes a family's
#: small model (4-bit affine in groups of 64, 8-bit, mxfp4), as a user downloads it.
QUANTIZED = [
    ("llama", "affine", 4),
    ("qwen3_moe", "affine", 8),
    ("gemma3", "mxfp4", 4),
    ("qwen3_5_moe", "affine", 4),
]


@pytest.mark.parametrize(("family", "mode", "bits"), QUANTIZED)
def test_a_quantized_checkpoint_runs_as_mlx_lm_runs_it(
    family: str, mode: str, bits: int, workspace: tuple[Path, Path], tmp_path: Path
) -> None:
    """mlx-lm's quantized weights (its ``convert``: the quantization config and ``sanitize``
    honoured) load, pass the self-check, and give mlx-lm's own greedy tokens."""

    from langchain_agent_memory.engine.engine import Engine
    from langchain_agent_memory.testing.model_matrix import _texts, against_mlx_lm

    root, tokenizer = workspace
    quantized = build_quantized(
        family, mode, bits, root / "models", tokenizer, tmp_path / f"{family}-{mode}{bits}"
    )
    engine = Engine(quantized, cache_dir=tmp_path / "kv", kv_bits=None)
    try:
        assert engine.lm.check is not None and engine.lm.check.passed
        _, differs = against_mlx_lm(engine, quantized, _texts()[0])
        assert not differs, differs
    finally:
        engine.close()
        unload_models(quantized)


def test_quantized_layers_multiplying_rows_dequantized_give_mlx_lms_logits(
    workspace: tuple[Path, Path], tmp_path: Path
) -> None:
    """CUDA's way around mlx's multi-row quantized matmul there (``cuda_quantized``: the
    loaded instance's quantized layers multiply more than one row through their dequantized
    weights), run on the CPU where both products exist: a prompt's logits and then a decode
    step's equal those of mlx's quantized kernel (a one-row call is that kernel itself)."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load

    from langchain_agent_memory.engine.model import cuda_quantized
    from langchain_agent_memory.engine.ops.runtime import mx

    root, tokenizer = workspace
    path = build_quantized("llama", "affine", 4, root / "models", tokenizer, tmp_path / "llama-affine4")
    (plain, _), (changed, _) = load(str(path)), load(str(path))
    quantized = [m for _, m in plain.named_modules() if type(m).__name__.startswith("Quantized")]
    assert cuda_quantized.dequantize_rows(changed) == len(quantized) > 0
    assert not any(
        type(m) in (mx_nn.QuantizedLinear, mx_nn.QuantizedEmbedding) for _, m in changed.named_modules()
    )
    ids = mx.array([[5 + 7 * i % 300 for i in range(40)]])
    runs = []
    for model in (plain, changed):
        cache = make_prompt_cache(model)
        prompt = model(ids, cache=cache)
        step = model(mx.array([[11]]), cache=cache)
        mx.eval(prompt, step)
        runs.append((prompt, step))
    (p0, s0), (p1, s1) = runs
    scale = mx.abs(p0).max().item()
    assert mx.abs(p1 - p0).max().item() <= 1e-4 * scale, "a prompt's rows differ beyond rounding"
    assert mx.abs(s1 - s0).max().item() <= 1e-4 * scale  # its keys and values came from the prompt's rows
    unload_models(path)


def test_a_self_check_pass_is_remembered_and_a_new_mlx_lm_checks_again(
    workspace: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first load of a model runs its self-check; a later load (another process: the
    model let go here) finds the pass remembered under the cache directory and skips it;
    what the pass is valid for includes the versions of mlx-lm (a new one checks again)."""
    import importlib.metadata

    from langchain_agent_memory.engine import load_model

    model = build("qwen3", tmp_path / "models", workspace[1])
    first = load_model(model, cache_dir=tmp_path)
    assert first.check is not None and first.check.passed and not first.check.remembered
    assert first.check.runs and max(first.check.runs.values()) < first.check.tolerance
    unload_models(model)
    again = load_model(model, cache_dir=tmp_path)
    assert again.check is not None and again.check.remembered
    unload_models(model)
    version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda d: "9.9.9" if d == "mlx-lm" else version(d))
    upgraded = load_model(model, cache_dir=tmp_path)
    assert upgraded.check is not None and not upgraded.check.remembered
    unload_models(model)


def test_a_model_loaded_on_one_thread_runs_on_the_engines_worker(
    workspace: tuple[Path, Path], tmp_path: Path
) -> None:
    """Gemma 3n makes arrays in its constructor that are no parameters; a lazy array made
    on one thread cannot be evaluated on another ("There is no Stream(cpu, 0) in current
    thread", mlx-lm's own model fails so). Loaded here without a self-check (as when a pass is
    remembered: nothing evaluates them on this thread), its first request on the engine's
    worker thread runs."""
    from langchain_agent_memory.engine import load_model
    from langchain_agent_memory.engine.engine import Engine
    from langchain_agent_memory.testing.model_matrix import GREEDY

    model = build("gemma3n", tmp_path / "models", workspace[1])
    load_model(model, cache_dir=tmp_path, self_check=False)
    engine = Engine(model, cache_dir=tmp_path / "kv")
    try:
        assert engine.generate("x", "Hello there, how are you?", GREEDY).completion_tokens > 0
    finally:
        engine.close()
        unload_models(model)


def test_moe_experts_of_16_bit_weights_on_the_cpu_are_refused_with_what_to_do(
    workspace: tuple[Path, Path], tmp_path: Path
) -> None:
    """mlx's CPU ``gather_mm`` multiplies float32 only: a bf16 MoE checkpoint crashed the
    engine's load with mlx's "[GatherMM::eval] Currently only supports float32" (the
    matrix at bf16 weights on the CPU: 41 MoE families). Refused, saying what runs it."""
    if device.on_gpu():
        pytest.skip("a GPU multiplies 16-bit experts")
    from langchain_agent_memory.engine.engine import Engine
    from langchain_agent_memory.engine.model.structure import UnsupportedModelError
    from langchain_agent_memory.testing.family_configs import family_config
    from langchain_agent_memory.testing.random_model import write_random_model

    model = write_random_model(family_config("mixtral"), tmp_path / "moe", workspace[1], dtype="bfloat16")
    with pytest.raises(UnsupportedModelError, match="bfloat16 weights") as refused:
        Engine(model, cache_dir=tmp_path / "c")
    assert "convert" in str(refused.value) and " -q" in str(refused.value)


def test_a_warm_turn_equals_the_hot_one_on_bf16_weights_through_the_cpu_kernels(
    workspace: tuple[Path, Path], tmp_path: Path
) -> None:
    """An mlx-lm directory of bf16 weights runs at bf16 on the CPU too (only a GGUF is
    converted to float32). There the warm turn's prefill in the codec's rotated space
    rounded otherwise than the hot turn's in the model's space: at 4-bit KV, exaone4's
    warm reload parted from its hot run at the second token of the turn (the matrix at bf16,
    float32 logit gap 0.14 against a bf16 error of 0.03)."""
    if device.on_gpu():
        pytest.skip("the CPU kernels' path")
    from langchain_agent_memory.engine.engine import Engine
    from langchain_agent_memory.testing.family_configs import family_config
    from langchain_agent_memory.testing.random_model import write_random_model

    model = write_random_model(
        family_config("exaone4"), tmp_path / "m", workspace[1], seed=7, dtype="bfloat16"
    )
    long = corpus.apache_license()[:3000]
    with Engine(model, cache_dir=tmp_path / "hot", kv_bits=4) as hot:
        first = hot.generate("x", long, GREEDY)
        follow = long + first.text + " Next:"
        hot_turn = hot.generate("x", follow, GREEDY)
    with Engine(model, cache_dir=tmp_path / "warm", kv_bits=4) as before:
        assert before.generate("x", long, GREEDY).text == first.text
    with Engine(model, cache_dir=tmp_path / "warm", kv_bits=4) as warm:
        warm_turn = warm.generate("x", follow, GREEDY)
    assert str(hot_turn.outcome).startswith("hot") and str(warm_turn.outcome).startswith("warm")
    assert warm_turn.text == hot_turn.text


def test_the_bf16_oracle_tells_a_near_tie_from_a_wrong_token(
    workspace: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At bfloat16 weights (a GPU's) two correct runs may part where two tokens' logits lie
    within the step's rounding error; the matrix then accepts the parting and nothing else:
    the top token against itself is a tie, against the least likely one it is not; against
    mlx-lm (``reference``) ours may lead at float32 by any amount (mlx-lm's rounding took
    the worse token) but not trail beyond the rounding; and at float32 weights (``exact``)
    any difference fails."""
    from langchain_agent_memory.testing.family_configs import family_config
    from langchain_agent_memory.testing.model_matrix import _mlx_lm_logits, exact, near_tie, same_tokens
    from langchain_agent_memory.testing.random_model import write_random_model

    model = write_random_model(
        family_config("llama"), tmp_path / "bf16", workspace[1], seed=7, dtype="bfloat16"
    )
    ids = list(range(5, 60))
    logits = _mlx_lm_logits(model, ids, None)
    top, bottom = int(logits.argmax().item()), int(logits.argmin().item())
    tie, numbers = near_tie(model, ids, top, top)
    assert tie, numbers
    wrong, numbers = near_tie(model, ids, top, bottom)
    assert not wrong and "bf16 error" in numbers
    ahead, numbers = near_tie(model, ids, top, bottom, reference=True)
    assert ahead, numbers  # ours the float32 top, mlx-lm's far below: mlx-lm's rounding
    behind, numbers = near_tie(model, ids, bottom, top, reference=True)
    assert not behind, numbers  # ours far below mlx-lm's at float32: a wrong layer
    monkeypatch.setenv("MATRIX_WEIGHTS", "float32")
    monkeypatch.setenv("MLX_ENABLE_TF32", "0")
    assert exact()
    agree, why = same_tokens(model, ids, [top, 1, 2], [top, 1, 3])
    assert not agree and "step 2" in why


def test_a_model_self_checked_on_one_thread_runs_on_the_engines_worker(
    workspace: tuple[Path, Path], tmp_path: Path
) -> None:
    """Gemma 3n's AltUp modules reassign their coefficient weights on every call, and its
    self-check's batched step stops part-way (its KV-shared layers take no batch), on the
    loading thread. Left lazy arrays of that thread, those weights failed the first request
    on the engine's worker ("There is no Stream(cpu, 0) in current thread": the matrix's
    Gemma 3n failure, in every process where no pass of its check was remembered)."""
    from langchain_agent_memory.engine import load_model
    from langchain_agent_memory.engine.engine import Engine
    from langchain_agent_memory.testing.model_matrix import GREEDY

    model = build("gemma3n", tmp_path / "models", workspace[1])
    loaded = load_model(model, cache_dir=tmp_path)  # a memo of its own: the check runs here
    assert loaded.check is not None and not loaded.check.remembered and loaded.check.unbatched
    engine = Engine(model, cache_dir=tmp_path / "kv")
    try:
        assert engine.lm is loaded
        assert engine.generate("x", "Hello there, how are you?", GREEDY).completion_tokens > 0
    finally:
        engine.close()
        unload_models(model)


def test_a_pass_that_fails_on_one_thread_leaves_the_model_to_run_on_another(
    workspace: tuple[Path, Path], tmp_path: Path
) -> None:
    """A forward pass that raises part-way (Gemma 3n over a batch's caches) leaves nothing
    of the model lazy on its thread: the next pass over the same instance, on another thread
    (another engine's worker), runs. mlx-lm's own modules here (``cpu_kernels=False``): their
    pass writes to the model."""
    import threading

    from langchain_agent_memory.engine import load_model
    from langchain_agent_memory.engine.kv import KVQuant, batch_layer_caches, make_layer_caches
    from langchain_agent_memory.engine.model.forward import LAST, forward_of
    from langchain_agent_memory.engine.ops.runtime import mx

    model = build("gemma3n", tmp_path / "models", workspace[1])
    loaded = load_model(model, cache_dir=tmp_path, self_check=False, cpu_kernels=False)
    spec, forward = loaded.structure.spec, forward_of(loaded.model)
    ids = list(range(5, 29))

    def filled(n: int) -> list[object]:
        caches = make_layer_caches(spec, KVQuant.uniform(None))
        mx.eval(forward(mx.array(ids[:n])[None], caches, LAST))
        return caches

    outcome: dict[str, object] = {}

    def fail_part_way() -> None:
        batch = batch_layer_caches([filled(16), filled(24)])
        try:
            forward(mx.array([[ids[0]], [ids[0]]]), batch, None)
        except AttributeError as exc:  # its KV-shared layers ask the batch for keys it has not
            outcome["failed"] = exc

    def run() -> None:
        logits = forward(mx.array(ids)[None], make_layer_caches(spec, KVQuant.uniform(None)), LAST)
        outcome["logits"] = logits.tolist()  # raised here before: the AltUp weights were lazy

    try:
        for step in (fail_part_way, run):
            thread = threading.Thread(target=step)
            thread.start()
            thread.join()
        assert "failed" in outcome and "logits" in outcome
    finally:
        unload_models(model)


def test_passes_over_one_model_on_two_threads_at_once_run_and_leave_it_as_loaded(
    workspace: tuple[Path, Path], tmp_path: Path
) -> None:
    """Two engines of one model share its loaded instance, each running passes on its own
    worker. mlx-lm's Gemma 3n writes its AltUp coefficient weights in every pass: two passes
    at once read each other's lazy arrays ("There is no Stream(cpu, N) in current thread")
    or crashed the process. The engine's instance writes nothing in a pass."""
    import threading

    from langchain_agent_memory.engine import load_model
    from langchain_agent_memory.engine.kv import KVQuant, make_layer_caches
    from langchain_agent_memory.engine.model.forward import LAST, forward_of
    from langchain_agent_memory.engine.ops.runtime import mx

    model = build("gemma3n", tmp_path / "models", workspace[1])
    loaded = load_model(model, cache_dir=tmp_path, self_check=False)
    spec, forward = loaded.structure.spec, forward_of(loaded.model)
    held = dict(tree_flatten(loaded.model.parameters()))
    ids = list(range(5, 70))
    got: dict[int, list[list[float]]] = {}

    def run(n: int) -> None:
        for _ in range(20):
            logits = forward(mx.array(ids)[None], make_layer_caches(spec, KVQuant.uniform(None)), LAST)
            got[n] = logits.astype(mx.float32).tolist()

    try:
        threads = [threading.Thread(target=run, args=(n,)) for n in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(got) == 2 and got[0] == got[1]
        after = dict(tree_flatten(loaded.model.parameters()))
        assert after.keys() == held.keys() and all(after[k] is held[k] for k in held)
    finally:
        unload_models(model)
