"""The self-check a model passes before the engine serves it: the engine's logits over its
own caches against mlx-lm's own forward over mlx-lm's own caches, on a few dozen tokens.

Support is decided by structure (``structure``), and structure alone cannot prove that a
model reaches its keys and values only through its caches, or that its head is what the
engine thinks. So a model is run both ways on the same ids: two prefill chunks, an
EXTEND after a commit (the chunk attends over the stored form, at 16 bits), two decode
steps; mlx-lm's ``model(tokens, cache=make_prompt_cache(model))`` is the reference, and the
engine's runs are its caches over the same model instance — mlx-lm's attention code
(before the instance is adapted) and the CPU kernels (after), each with a working copy and
on the stored form. The largest logit difference, relative to the reference's largest
logit, must stay within ``TOLERANCE`` for the model's dtype; otherwise the model is
refused, with the step and the first cache slot whose keys or state differ.

A pass is remembered per (weights, config, mlx-lm and package versions, device) in
``<cache_dir>/models/self-checks.json``: later loads skip it.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..kv import KVQuant, LayerCache, RecurrentCache, batch_layer_caches, make_layer_caches
from ..ops import device
from ..ops.files import atomic_write_bytes
from ..ops.runtime import mx
from .fingerprint import weights_digest
from .forward import LAST, forward_of
from .structure import ModelStructure, UnsupportedModelError

logger = logging.getLogger(__name__)

#: Token ids of the check, by step: two prefill chunks, an EXTEND after a commit; then two
#: decode steps of the reference's greedy tokens. Small ids: every vocabulary has them.
CHUNKS = ((0, 16), (16, 32), (32, 40))
DECODE_STEPS = 2
#: Largest |engine - mlx-lm| over the largest |mlx-lm logit|, by activation dtype. What a
#: model that computes the same thing differs by: float16 keys and values (the engine's
#: 16-bit form) and another summation order; a model that attends elsewhere, masks
#: differently or loses its head's scaling differs by tenths or more.
TOLERANCE = {"float32": 0.01, "float16": 0.04, "bfloat16": 0.08}
_MEMO_FILE = "self-checks.json"
#: The engine's runs, by name: (prefill in the rotated space, attend on the stored form).
#: ``MLX_RUNS`` before the instance is adapted (mlx-lm's attention code over the engine's
#: caches), ``adapted_runs`` after (its attention through the engine's caches: the CPU
#: kernels, or on a GPU the stored form's kernels).
MLX_RUNS = {"mlx-lm attention, working copy": (False, False), "mlx-lm attention, stored form": (False, True)}


def adapted_runs(rotated: bool) -> dict[str, tuple[bool, bool]]:
    """The runs after adapting; ``rotated``: its prefill works in the codec's rotated space
    (the CPU kernels: ``Engine``'s ``prefill_rotated``)."""
    where = "CPU kernels" if rotated else "engine attention"
    return {f"{where}, working copy": (rotated, False), f"{where}, stored form": (rotated, True)}


def tolerance(structure: ModelStructure) -> float:
    return TOLERANCE.get(structure.spec.dtype, max(TOLERANCE.values()))


@dataclass(slots=True)
class CheckResult:
    """The verdict: ``passed``, the worst relative error and where it was."""

    passed: bool
    max_error: float
    tolerance: float
    worst: str = ""  # which run and step
    differs: str = ""  # the first cache slot whose keys / state differ, when it failed
    runs: dict[str, float] = field(default_factory=dict)  # run -> its worst error
    seconds: float = 0.0
    remembered: bool = False
    #: Why the model's agents decode one at a time ("": they batch; ``batch_agrees``).
    unbatched: str = ""

    def merged(self, other: CheckResult) -> CheckResult:
        """Both checks' runs: passed if both did, the worse error and where it was."""
        worst = self if self.max_error >= other.max_error else other
        return CheckResult(
            self.passed and other.passed, worst.max_error, self.tolerance, worst.worst,
            self.differs or other.differs, {**self.runs, **other.runs}, self.seconds + other.seconds,
            unbatched=self.unbatched or other.unbatched,
        )  # fmt: skip

    def summary(self) -> str:
        if self.remembered:
            return "passed (remembered)"
        verdict = "passed" if self.passed else "FAILED"
        text = f"{verdict}: max logit error {self.max_error:.2e} (tolerance {self.tolerance:g})"
        text += f" at {self.worst}"
        return text + (f"; {self.differs}" if self.differs else "")


def _ids(vocab: int) -> list[int]:
    # A fixed, spread set of ids (no RNG): ordinary tokens, far from special ones at 0..2.
    n = CHUNKS[-1][1]
    return [(3 + 7919 * i) % max(4, min(vocab, 30000)) for i in range(n)]


def _vocab(model: Any) -> int:
    return int(model(mx.array([[1]]), cache=_mlx_caches(model)).shape[-1])


def _mlx_caches(model: Any) -> list[Any]:
    from mlx_lm.models.cache import make_prompt_cache

    return make_prompt_cache(model)


@dataclass(slots=True)
class Reference:
    """mlx-lm's own run: the last logits of each step, its greedy decode tokens, its caches."""

    ids: list[int]
    logits: list[mx.array]
    decoded: list[int]
    caches: list[Any]


def reference(model: Any, structure: ModelStructure) -> Reference:
    """mlx-lm's forward over mlx-lm's caches (run before the instance is adapted)."""
    ids = _ids(_vocab(model))
    caches = _mlx_caches(model)
    logits = []
    for a, b in CHUNKS:
        logits.append(model(mx.array(ids[a:b])[None], cache=caches)[0, -1].astype(mx.float32))
    decoded = []
    for _ in range(DECODE_STEPS):
        token = int(mx.argmax(logits[-1]).item())
        decoded.append(token)
        logits.append(model(mx.array([[token]]), cache=caches)[0, -1].astype(mx.float32))
    mx.eval(logits)
    return Reference(ids, logits, decoded, structure.layout.leaves(caches))


_STEPS = ("prefill chunk 1", "prefill chunk 2", "extend after a commit", "decode step 1", "decode step 2")


def engine_run(
    model: Any, structure: ModelStructure, ref: Reference, rotated: bool, stored: bool
) -> tuple[list[mx.array], list[Any]]:
    """The engine's caches (16-bit form) over the same ids: each step's last logits, and
    the caches."""
    flat = make_layer_caches(
        structure.spec, KVQuant.uniform(None), prefill_rotated=rotated, serve_stored=stored
    )
    forward = forward_of(model)
    out = []
    for n, (a, b) in enumerate(CHUNKS):
        if n == len(CHUNKS) - 1:
            for c in flat:
                c.commit(keep_work=True)  # a turn ends: the next chunk attends over the stored form
        out.append(forward(mx.array(ref.ids[a:b])[None], flat, LAST)[0, -1].astype(mx.float32))
    for token in ref.decoded:
        out.append(forward(mx.array([[token]]), flat, None)[0, -1].astype(mx.float32))
    mx.eval(out)
    return out, flat


def _said(exc: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _error(mine: mx.array, ref: mx.array) -> float:
    scale = max(float(mx.abs(ref).max().item()), 1e-6)
    return float(mx.abs(mine - ref).max().item()) / scale


def _first_difference(flat: Sequence[Any], ref: Reference, structure: ModelStructure, tol: float) -> str:
    """The first cache slot whose full-attention keys or recurrent state differ from
    mlx-lm's (sliding layers hold a rotated buffer there: not compared)."""
    from mlx_lm.models.cache import ArraysCache, KVCache

    for i, (mine, theirs) in enumerate(zip(flat, ref.caches, strict=True)):
        kind = structure.layout.kinds[i]
        if isinstance(mine, RecurrentCache) and isinstance(theirs, ArraysCache):
            for j, (x, y) in enumerate(zip(mine.cache, theirs.cache, strict=True)):
                if x is not None and y is not None and _error(x, y) > tol:
                    return f"slot {i} ({kind}): state array {j} differs by {_error(x, y):.2e}"
        elif isinstance(mine, LayerCache) and type(theirs) is KVCache and theirs.keys is not None:
            keys, values = mine.held_kv(mx.float32)
            for what, x, y in (("keys", keys, theirs.keys), ("values", values, theirs.values)):
                y = y[..., : theirs.offset, :].astype(mx.float32)
                if x.shape != y.shape:
                    return f"slot {i} ({kind}): {what} of shape {x.shape} where mlx-lm keeps {y.shape}"
                if _error(x, y) > tol:
                    return f"slot {i} ({kind}): {what} differ by {_error(x, y):.2e}"
    return "every full-attention slot's keys and values agree: the difference is after them"


def check(
    model: Any, structure: ModelStructure, ref: Reference, runs: dict[str, tuple[bool, bool]]
) -> CheckResult:
    """Run the engine ``runs`` (name -> (prefill rotated, stored form)) against ``ref``."""
    tol = tolerance(structure)
    result = CheckResult(True, 0.0, tol)
    t0 = time.perf_counter()
    for name, (rotated, stored) in runs.items():
        try:
            got, flat = engine_run(model, structure, ref, rotated, stored)
        except Exception as exc:  # the model's code cannot run over the engine's caches
            result.passed, result.max_error, result.worst = False, float("inf"), name
            result.differs = f"it fails over the engine's caches: {_said(exc)}"
            break
        errors = [_error(g, r) for g, r in zip(got, ref.logits, strict=True)]
        worst = max(range(len(errors)), key=errors.__getitem__)
        result.runs[name] = errors[worst]
        if errors[worst] > result.max_error:
            result.max_error, result.worst = errors[worst], f"{name}, {_STEPS[worst]}"
        if errors[worst] > tol and result.passed:
            result.passed = False
            result.differs = _first_difference(flat, ref, structure, tol)
    if result.passed:
        result.unbatched = batch_agrees(model, structure, ref, runs)
    result.seconds = time.perf_counter() - t0
    return result


def batch_agrees(
    model: Any, structure: ModelStructure, ref: Reference, runs: dict[str, tuple[bool, bool]]
) -> str:
    """Whether one decode step of two agents of different lengths, batched, gives each the
    logits it gets alone ("" where it does; else what differed). A model whose attention
    code shapes the batch's mask its own way (Gemma 2's grouped queries) cannot take the
    engine's: its agents then decode one at a time."""
    forward = forward_of(model)
    token = mx.array([[ref.decoded[0]], [ref.decoded[0]]])
    for name, (rotated, stored) in runs.items():

        def filled(n: int, rotated: bool = rotated, stored: bool = stored) -> list[Any]:
            flat = make_layer_caches(
                structure.spec, KVQuant.uniform(None), prefill_rotated=rotated, serve_stored=stored
            )
            forward(mx.array(ref.ids[:n])[None], flat, LAST)
            return flat

        a, b = filled(16), filled(24)
        alone = [forward(token[:1], filled(n), None)[0, -1].astype(mx.float32) for n in (16, 24)]
        try:
            batch = batch_layer_caches([a, b], merge=device.merged_batch())
            together = forward(token, batch, None)[:, -1].astype(mx.float32)
            error = max(_error(together[i], alone[i]) for i in (0, 1))
            if not structure.spec.hybrid:  # two whole prompts in one pass, right-padded
                error = max(error, _prefill_error(forward, structure, ref, rotated, stored))
        except Exception as exc:
            return f"{name}: {_said(exc)}"
        if error > tolerance(structure):
            return f"{name}: a batched row differs by {error:.2e}"
    return ""


def _prefill_error(
    forward: Any, structure: ModelStructure, ref: Reference, rotated: bool, stored: bool
) -> float:
    """Two prompts (16 and 24 tokens) prefilled in one pass, the shorter padded on the right
    (``ModelRunner.prefill_whole``), against each alone: the largest relative difference."""

    def fresh() -> list[Any]:
        return make_layer_caches(
            structure.spec, KVQuant.uniform(None), prefill_rotated=rotated, serve_stored=stored
        )

    alone = [forward(mx.array(ref.ids[:n])[None], fresh(), LAST)[0, -1].astype(mx.float32) for n in (16, 24)]
    tokens = mx.array([ref.ids[:16] + ref.ids[15:16] * 8, ref.ids[:24]])
    batch = batch_layer_caches([fresh(), fresh()], merge=False, merge_stored=False, merge_prefix=False)
    rows = forward(tokens, batch, mx.array([15, 23]))[:, -1].astype(mx.float32)
    return max(_error(rows[i], alone[i]) for i in (0, 1))


def refusal(name: str, result: CheckResult) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"{name}: the engine's output differs from mlx-lm's own on this model ({result.summary()}). "
        "agent-memory refuses it rather than answer differently from mlx-lm; please report the "
        "model family"
    )


# ------------------------------------------------------------------ remembered passes


def check_key(model_dir: Path, device: str, memo_dir: Path | None) -> str:
    """What a pass is valid for: the weights' content, the config, the versions of mlx-lm
    and of this package, the device."""
    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    for f in sorted(model_dir.glob("*.safetensors")):
        h.update(f.name.encode() + weights_digest(f, memo_dir).encode())
    for dist in ("mlx-lm", "mlx", "langchain-agent-memory"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            h.update(f"{dist}={importlib.metadata.version(dist)}".encode())
    h.update(device.encode())
    return h.hexdigest()


def remembered(memo_dir: Path | None, key: str) -> dict[str, Any] | None:
    if memo_dir is None:
        return None
    try:
        data = json.loads((memo_dir / _MEMO_FILE).read_text())
    except (OSError, ValueError):
        return None
    entry = data.get(key) if isinstance(data, dict) else None
    return entry if isinstance(entry, dict) else None


def remember(memo_dir: Path | None, key: str, model: str, model_dir: Path, result: CheckResult) -> None:
    """Keep a pass under ``key`` (and forget those of models whose directory is gone)."""
    if memo_dir is None:
        return
    path = memo_dir / _MEMO_FILE
    try:
        data = json.loads(path.read_text())
        data = data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        data = {}
    data = {k: e for k, e in data.items() if isinstance(e, dict) and Path(str(e.get("path", ""))).exists()}
    data[key] = {
        "model": model,
        "path": str(model_dir.resolve()),
        "max_error": result.max_error,
        "unbatched": result.unbatched,
        "checked": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    # Only a memo: a failed write costs a second check later, nothing else.
    with contextlib.suppress(OSError):
        memo_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, json.dumps(data, indent=1, sort_keys=True).encode())
