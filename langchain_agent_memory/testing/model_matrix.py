"""The model matrix: every text family of the installed mlx-lm, built from a small config
(``family_configs``, random weights), run through the whole engine and compared with
mlx-lm itself. tests/integration/test_model_matrix.py runs it; its verdicts are recorded in
``engine/model/family_verdicts.json``, which ``agent-memory models`` and the docs' model
table are made from (``python -m langchain_agent_memory.testing.model_matrix`` writes both).

Per family, one set of engines over one model directory, each check an oracle:

- ``loads``: the structure is one the engine stores and the self-check passes;
- ``mlx-lm``: greedy text at 16-bit KV == mlx-lm's own ``generate_step`` on the same ids
  (an instance of mlx-lm's own, not adapted: the engine must not change the model's math);
- ``reload``: a new engine reading the agent from disk == the uninterrupted run;
- ``diverge``: a DIVERGE from the stored text == a cold run of the same prompt;
- ``batched``: three agents decoding together == each alone;
- ``fork``: three agents released together over a shared prefix (forks) == each alone, cold;
- ``4-bit``: the default KV format reloads like the hot run.

Token for token where the arithmetic allows it: float32 weights (the CPU's, or a GPU's with
``MATRIX_WEIGHTS=float32`` and TF32 off, ``MLX_ENABLE_TF32=0``). At bfloat16 weights, as a
GPU runs by default, two correct computations of one step (mlx-lm's and the engine's, a
prefill and a decode, a batch and a single row) round differently, and random weights make
near-ties: there two runs may part where the two tokens' logits lie within that rounding of
each other, and nowhere else (``near_tie``). Which two tokens are near is judged at float32,
the same weights computed without bf16's rounding: mlx-lm's own bf16 decode is one rounding
among others (on a random Llama at bf16 its ``generate_step`` took a token that its own
full forward and the float32 model both rank second, where the engine took the first). A
wrong layer moves logits far beyond the rounding.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..engine.engine import Engine, GenerationParams, GenerationResult
from ..engine.model import cuda_quantized
from ..engine.model.families import VERDICTS_FILE
from ..engine.model.loading import unload_models
from ..engine.model.structure import UnsupportedModelError
from ..engine.ops import device
from ..engine.ops.runtime import mx
from ..engine.prefix import MatchKind
from . import corpus
from .family_configs import family_config, text_families, unbuildable
from .random_model import write_random_model

CHECKS = ("loads", "mlx-lm", "reload", "diverge", "batched", "fork", "4-bit")
GREEDY = GenerationParams(max_tokens=8)
#: Two tokens are a near-tie where their float32 logits differ by at most this many times
#: the step's bfloat16 logit error (the largest over the vocabulary, bf16 against float32):
#: each run's logits may have moved by that much, so their order may have flipped.
TIE_MARGIN = 2.0


#: An engine, an agent and its last turn's result: what ``turn_tokens`` reads.
Turn = tuple[Engine, str, GenerationResult]


def weight_dtype() -> str:
    """The dtype the matrix builds its models in: ``MATRIX_WEIGHTS``, else the device's."""
    return os.environ.get("MATRIX_WEIGHTS") or device.weight_dtype()


def exact() -> bool:
    """Whether every check must hold token for token: float32 weights computed as float32
    (TF32 off on a GPU: ``MLX_ENABLE_TF32=0``, read by mlx when it starts)."""
    return weight_dtype() == "float32" and (not device.on_gpu() or os.environ.get("MLX_ENABLE_TF32") == "0")


def _mlx_lm_load(model_dir: Path) -> tuple[Any, Any]:
    """mlx-lm's own load of ``model_dir`` (not the engine's instance). On CUDA its quantized
    layers multiply more than one row dequantized, as the engine's do (``cuda_quantized``:
    mlx's multi-row quantized matmul there did not return): the same weights, the same
    model code, a product mlx can run."""
    from mlx_lm.utils import load

    model, tokenizer = load(str(model_dir))
    if cuda_quantized.needed():
        cuda_quantized.dequantize_rows(model)
    return model, tokenizer


def _mlx_lm_logits(model_dir: Path, ids: list[int], dtype: mx.Dtype | None) -> mx.array:
    """mlx-lm's own model's float32 logits after ``ids`` (its weights cast to ``dtype``)."""
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = _mlx_lm_load(model_dir)
    if dtype is not None:
        model.set_dtype(dtype)
    logits = model(mx.array(ids)[None], cache=make_prompt_cache(model))[0, -1].astype(mx.float32)
    mx.eval(logits)
    del model
    return logits


def near_tie(model_dir: Path, ids: list[int], a: int, b: int, reference: bool = False) -> tuple[bool, str]:
    """Whether token ``a`` (ours) against ``b`` after ``ids`` is within the rounding of the
    model's weights: their float32 logits (the same weights, computed without bf16's
    rounding) within ``TIE_MARGIN`` times the step's bf16 logit error (the largest
    difference over the vocabulary between the model at its weights and at float32).
    ``reference``: ``b`` is a reference's (mlx-lm's) token, and ``a`` may be ahead of it
    by any amount (the reference's own rounding took the worse one); else the two runs are
    peers and either may lead by the margin only. And the numbers, for the report."""
    logits = _mlx_lm_logits(model_dir, ids, None)
    exact_logits = _mlx_lm_logits(model_dir, ids, mx.float32)
    error = mx.max(mx.abs(logits - exact_logits)).item()
    behind = exact_logits[b].item() - exact_logits[a].item()  # > 0: b is ahead at float32
    tie = (behind if reference else abs(behind)) <= TIE_MARGIN * error
    return tie, f"float32 logit of {b} - {a}: {behind:+.4f}, bf16 error {error:.4f}"


def same_tokens(
    model_dir: Path, prompt: list[int], ours: list[int], theirs: list[int], reference: bool = False
) -> tuple[bool, str]:
    """Whether two greedy continuations of ``prompt`` agree: equal where ``exact()``;
    otherwise equal up to their first difference, which must be a near-tie (``near_tie``,
    ``reference`` where ``theirs`` is mlx-lm's: after it the two runs continue from
    different texts). The reason, where they differ."""
    if ours == theirs:
        return True, ""
    shorter = min(len(ours), len(theirs))
    at = next((i for i in range(shorter) if ours[i] != theirs[i]), shorter)
    where = f"tokens differ at step {at}: {ours} / {theirs}"
    if exact() or at == shorter:  # one ended (EOS) where the other went on
        return False, where
    tie, numbers = near_tie(model_dir, prompt + ours[:at], ours[at], theirs[at], reference)
    return tie, f"{where} ({numbers}: {'a near-tie' if tie else 'not a near-tie'})"


def turn_tokens(engine: Engine, agent: str, result: GenerationResult) -> tuple[list[int], list[int]]:
    """The prompt's and the reply's token ids of ``agent``'s last turn, as stored."""
    engine.flush()
    record = engine.admin.agent_record(agent)
    assert record is not None
    ids = list(record.token_ids)
    return ids[: result.prompt_tokens], ids[
        result.prompt_tokens : result.prompt_tokens + result.completion_tokens
    ]


def _texts() -> tuple[str, dict[str, str], dict[str, str]]:
    # ~620 tokens: two whole blocks (a hybrid's snapshots, forks), past the 48-token windows.
    long = corpus.apache_license()[:3000]
    prompts = {
        "lawyer": long[:1100] + "\n\nQ: Its name?\nA:",
        "tutor": "You teach Python.\n\n" + corpus.python_docs_topic("while")[:600] + "\n\nQ: while?\nA:",
        "poet": "Write a short poem about the sea.\n",
    }
    fan = {f"item-{i}": f"{long}\n\nQ: {q}\nA:" for i, q in enumerate(["Its name?", "Who?", "Sell?"])}
    return long, prompts, fan


def run_together(
    engine: Engine, prompts: dict[str, str], params: GenerationParams | dict[str, GenerationParams]
) -> dict[str, GenerationResult]:
    """Each agent's prompt on its own thread (with its own parameters where ``params`` maps
    agents to them), all released at once (a barrier): the engine runs them concurrently,
    their decode steps batched."""
    results: dict[str, GenerationResult] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(prompts))

    def run(agent: str) -> None:
        barrier.wait()
        try:
            results[agent] = engine.generate(
                agent, prompts[agent], params[agent] if isinstance(params, dict) else params
            )
        except BaseException as exc:  # raised in the caller's thread below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(a,)) for a in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


@dataclass(slots=True)
class FamilyReport:
    """One family's row: its cache kinds, verdict, and each check's outcome (None: not run)."""

    family: str
    kinds: str = ""
    verdict: str = "runs"  # "runs", "refused" (structure or self-check), "not built"
    reason: str = ""
    checks: dict[str, bool | None] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)  # check -> what differed
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        ran = self.verdict == "runs" and all(self.checks.get(c) for c in CHECKS)
        return ran or self.verdict == "refused"


class _Engines:
    """The engines of one family's checks (closed at the end: their memory goes)."""

    def __init__(self, model: Path, root: Path) -> None:
        self.model, self.root, self.made = model, root, []

    def __call__(self, where: str, **options: Any) -> Engine:
        options.setdefault("kv_bits", None)
        engine = Engine(self.model, cache_dir=self.root / where, **options)
        self.made.append(engine)
        return engine

    def close(self) -> None:
        for engine in self.made:
            with contextlib.suppress(Exception):
                engine.close()
        self.made.clear()


def _mlx_lm_greedy(model_dir: Path, ids: list[int], n: int) -> tuple[list[int], str]:
    """mlx-lm's own greedy tokens after ``ids`` (its own load, not the engine's instance)."""
    from mlx_lm.generate import generate_step

    model, tokenizer = _mlx_lm_load(model_dir)
    tokens = []
    for token, _ in generate_step(mx.array(ids), model, max_tokens=n):
        tokens.append(int(token))
    del model
    return tokens, tokenizer.decode(tokens)


def against_mlx_lm(engine: Engine, model_dir: Path, prompt: str) -> tuple[GenerationResult, str]:
    """Agent ``x``'s greedy turn on ``prompt``, and "" where its tokens (those stored) are
    mlx-lm's own ``generate_step``'s on the same ids (``same_tokens``), else what differed."""
    result = engine.generate("x", prompt, GREEDY)
    ids, reply = turn_tokens(engine, "x", result)
    theirs, text = _mlx_lm_greedy(model_dir, ids, result.completion_tokens)
    agree, why = same_tokens(model_dir, ids, reply, theirs[: len(reply)], reference=True)
    if agree and (text.strip() == result.text.strip() or not exact()):
        return result, ""
    return result, f"mlx-lm {theirs} {text!r} / engine {reply} {result.text!r}: {why}"


def check_family(family: str, model_dir: Path, root: Path) -> FamilyReport:
    """Every check of ``CHECKS`` on one family's model directory (cache dirs under ``root``)."""
    report = FamilyReport(family)
    t0 = time.perf_counter()
    engines = _Engines(model_dir, root)
    try:
        _run_checks(report, model_dir, engines)
    finally:
        engines.close()
        unload_models(model_dir)  # a matrix of a hundred models would otherwise hold them all
        report.seconds = time.perf_counter() - t0
    return report


def _run_checks(report: FamilyReport, model_dir: Path, engines: _Engines) -> None:
    long, prompts, fan = _texts()
    try:
        # Every state snapshot the policy picks (a hybrid's DIVERGE below resumes at one).
        hot = engines("hot", state_budget=None)
    except UnsupportedModelError as exc:
        reason = str(exc).replace(str(model_dir), report.family)  # no temporary path in the record
        report.verdict, report.reason, report.checks["loads"] = "refused", reason, False
        return
    layout = hot.lm.structure.layout
    report.kinds = layout.summary()
    report.checks["loads"] = True
    if not hot.lm.batches:  # served, its agents decoding one at a time
        report.reason = "its agents decode one at a time (its attention shapes a batch's mask its own way)"

    def verdict(check: str, ok: bool, detail: Callable[[], str]) -> None:
        report.checks[check] = ok
        if not ok:
            report.failures[check] = detail()

    def agree(text_equal: bool, ours: Turn, theirs: Turn) -> tuple[bool, str]:
        """Two runs that must agree: equal text, or (not ``exact()``) tokens that part at a
        near-tie (``same_tokens``); read at once, before either agent's next turn."""
        if text_equal or exact():
            return text_equal, ""
        prompt, reply = turn_tokens(*ours)
        return same_tokens(model_dir, prompt, reply, turn_tokens(*theirs)[1])

    # mlx-lm's own greedy tokens on the ids the engine ran.
    r1, differs = against_mlx_lm(hot, model_dir, long)
    verdict("mlx-lm", not differs, lambda: differs)

    # Reload == uninterrupted; DIVERGE == cold.
    p2 = long + r1.text + "\n\nQ: and the second part?\nA:"
    r2 = hot.generate("x", p2, GREEDY)
    engines("b").generate("x", long, GREEDY)
    reloaded = engines("b")  # a second engine over the first one's directory: a new process
    warm = reloaded.generate("x", p2, GREEDY)
    same, why = agree(warm.text == r2.text, (reloaded, "x", warm), (hot, "x", r2))
    verdict(
        "reload",
        # A hybrid's stored turn may resume at the snapshot one token before its end.
        str(warm.outcome).startswith("warm")
        and same
        and r2.reused_tokens - hot.spec.hybrid <= warm.reused_tokens <= r2.reused_tokens,
        lambda: (
            f"{warm.outcome} {warm.text!r} ({warm.reused_tokens}) / "
            f"hot {r2.text!r} ({r2.reused_tokens}) {why}"
        ),
    )
    # Past the first block: a hybrid resumes from its snapshot there.
    p3 = long[:2000] + " -- a different question entirely: what is a patent?"
    diverge = hot.generate("x", p3, GREEDY)
    fresh = engines("c")
    cold = fresh.generate("y", p3, GREEDY)
    same, why = agree(diverge.text == cold.text, (hot, "x", diverge), (fresh, "y", cold))
    verdict(
        "diverge",
        diverge.outcome.match is MatchKind.DIVERGE and same,
        lambda: f"{diverge.outcome} {diverge.text!r} / cold {cold.text!r} {why}",
    )

    # Batched == alone.
    alone = {agent: hot.generate(agent, p, GREEDY) for agent, p in prompts.items()}
    batched = engines("batched")
    together = run_together(batched, prompts, GREEDY)
    pairs = {
        a: agree(r.text == alone[a].text, (batched, a, r), (hot, a, alone[a])) for a, r in together.items()
    }
    verdict(
        "batched",
        all(same for same, _ in pairs.values()) and batched.stats()["max_decode_batch"] >= 2,
        lambda: (
            f"batched {[r.text for r in together.values()]} / alone {[r.text for r in alone.values()]}"
            f" (max batch {batched.stats()['max_decode_batch']}) {[why for _, why in pairs.values()]}"
        ),
    )

    # Fan-out: forks over a shared prefix == each alone, cold.
    by_itself = {agent: engines(f"alone-{agent}") for agent in fan}
    expected = {agent: by_itself[agent].generate(agent, p, GREEDY) for agent, p in fan.items()}
    fan_out = engines("fan-out")
    forked = run_together(fan_out, fan, GREEDY)
    shared = sorted(str(r.outcome) for r in forked.values())
    pairs = {
        a: agree(r.text == expected[a].text, (fan_out, a, r), (by_itself[a], a, expected[a]))
        for a, r in forked.items()
    }
    verdict(
        "fork",
        all(same for same, _ in pairs.values()) and shared.count("hot-shared") == 2,
        lambda: (
            f"{shared}: {[r.text for r in forked.values()]} / alone {[r.text for r in expected.values()]}"
            f" {[why for _, why in pairs.values()]}"
        ),
    )

    # The default 4-bit-class format: a reload equals the hot run.
    four = engines("4bit-hot", kv_bits=4)
    q1 = four.generate("x", long, GREEDY)
    q2 = four.generate("x", long + q1.text + " Next:", GREEDY)
    engines("4bit-b", kv_bits=4).generate("x", long, GREEDY)
    reloaded = engines("4bit-b", kv_bits=4)
    q_warm = reloaded.generate("x", long + q1.text + " Next:", GREEDY)
    same, why = agree(q_warm.text == q2.text, (reloaded, "x", q_warm), (four, "x", q2))
    verdict(
        "4-bit",
        str(q_warm.outcome).startswith("warm") and same,
        lambda: f"{q_warm.outcome} {q_warm.text!r} / hot {q2.text!r} {why}",
    )


def build(family: str, root: Path, tokenizer_dir: Path) -> Path:
    """The family's small random-weight model directory, in ``weight_dtype()`` (the device's:
    float32 on the CPU, its fast path; bfloat16 on a GPU, as users run models there)."""
    dtype = weight_dtype()
    return write_random_model(family_config(family), root / family, tokenizer_dir, seed=7, dtype=dtype)


def build_quantized(family: str, mode: str, bits: int, root: Path, tokenizer_dir: Path, out: Path) -> Path:
    """The family's small random model (``build``) quantized by mlx-lm's own ``convert``
    (``mode``: affine, mxfp4, ...; affine in groups of 64) into ``out``: a checkpoint as
    mlx-community publishes them."""
    from mlx_lm.convert import convert

    source = build(family, root, tokenizer_dir)
    group = 64 if mode == "affine" else None
    convert(str(source), str(out), quantize=True, q_bits=bits, q_mode=mode, q_group_size=group)
    return out


def families() -> list[str]:
    """The families the matrix runs: every one of mlx-lm's that a config can build."""
    skip = unbuildable()
    return [f for f in text_families() if f not in skip]


# ------------------------------------------------------------------ the recorded verdicts


def record(reports: dict[str, FamilyReport]) -> dict[str, Any]:
    """What ``family_verdicts.json`` holds: each family's kinds, verdict and reason."""
    import importlib.metadata

    rows = {
        f: {"kinds": r.kinds, "verdict": r.verdict, "reason": r.reason} for f, r in sorted(reports.items())
    }
    for family, why in sorted(unbuildable().items()):
        rows[family] = {"kinds": "", "verdict": "not built", "reason": why}
    return {"mlx_lm": importlib.metadata.version("mlx-lm"), "families": dict(sorted(rows.items()))}


def table(recorded: dict[str, Any]) -> str:
    """The docs' page of model families (Markdown), from the recorded verdicts."""
    rows = recorded["families"].items()
    runs = sum(1 for _, row in rows if row["verdict"] == "runs")
    lines = [
        "<!-- generated by `python -m langchain_agent_memory.testing.model_matrix`: do not edit -->",
        "# Model families",
        "",
        f"Every text family of mlx-lm {recorded['mlx_lm']}'s `models/`, as the test matrix found it",
        f"({runs} of {len(recorded['families'])} run): a small random-weight config of each family runs",
        "the whole engine, and every check must hold — greedy text at 16-bit KV equal to mlx-lm's own",
        "`generate_step` on the same ids, a reload equal to the uninterrupted run, a DIVERGE equal",
        "to a cold run, batched decode equal to decode alone, fan-out forks equal to each agent",
        "alone, the default 4-bit format reloading like the hot run. *Caches* are what the",
        "model's own `make_cache()` returns, as the engine stores them. A model of a family not",
        "listed, or of a newer mlx-lm, is decided the same way when it loads: by its caches and",
        "its self-check ([Models](../guides/models.md)).",
        "",
        "| family | caches | verdict |",
        "|---|---|---|",
    ]
    for family, row in rows:
        verdict = row["verdict"] if not row["reason"] else f"{row['verdict']}: {row['reason']}"
        lines.append(f"| `{family}` | {row['kinds']} | {verdict.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def write(reports: dict[str, FamilyReport], docs: Path) -> None:
    """Write the recorded verdicts and the docs' table from ``reports``."""
    recorded = record(reports)
    VERDICTS_FILE.write_text(json.dumps(recorded, indent=1, ensure_ascii=False) + "\n")
    docs.write_text(table(recorded))


@contextlib.contextmanager
def _workspace() -> Iterator[tuple[Path, Path]]:
    import tempfile

    from ..engine import resolve_model_dir

    with tempfile.TemporaryDirectory(prefix="model-matrix-") as tmp:
        yield Path(tmp), resolve_model_dir("smollm2-135m")[0]
        unload_models(Path(tmp))


def _rss_gb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def main(argv: list[str]) -> int:
    """Run the matrix (all families, or those named) and write the verdicts and the table;
    ``--docs``: only render the table again from the recorded verdicts."""
    docs = Path(__file__).resolve().parents[2] / "docs" / "models" / "families.md"
    if argv == ["--docs"]:
        from ..engine.model.families import recorded_verdicts

        docs.write_text(table(recorded_verdicts()))
        return 0
    wanted = argv or families()
    reports = {}
    with _workspace() as (root, tokenizer):
        for i, family in enumerate(wanted, 1):
            try:
                model = build(family, root / "models", tokenizer)
                report = check_family(family, model, root / "caches" / family)
            except Exception as exc:  # a family that breaks the engine: say so, go on
                import traceback

                traceback.print_exc()
                report = FamilyReport(family, verdict="error", reason=f"{type(exc).__name__}: {exc}")
            reports[family] = report
            said = f"{report.verdict} {report.kinds} {report.seconds:.1f} s"
            said += f" (peak RSS {_rss_gb():.2f} GB, {threading.active_count()} threads)"
            print(f"[{i}/{len(wanted)}] {family}: {said} {report.failures or report.reason}", flush=True)
            gc.collect()
    if not argv:
        write(reports, docs)
    return 0 if all(r.passed for r in reports.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
