"""Convert a GGUF file (llama.cpp's format) into an mlx-lm model directory.

The GGUF is read with the `gguf` package (the reference implementation of the format),
every tensor is dequantized with `gguf.quants`, renamed onto mlx-lm's module tree and
written as one safetensors file next to a `config.json`. The tokenizer is rebuilt from
the GGUF metadata by transformers' own GGUF tokenizer builders and saved as
`tokenizer.json` + `tokenizer_config.json` (with the chat template, when the file has one).

Supported architectures, each onto mlx-lm's family of the same design: ``llama``, ``gemma3``
(mlx-lm's ``gemma3_text``), ``qwen2``, ``qwen3``, ``qwen3moe`` (``qwen3_moe``), ``phi3`` and
``gemma2``; their tables (tensor names, config builders) are in ``gguf_archs``. What
llama.cpp's converter did on the way in is undone: llama's Q/K row permutation, Gemma's
``1 + w`` norm storage; Qwen's linear / YaRN RoPE scaling (metadata) and Phi-3's LongRoPE
factors (tensors) become ``rope_scaling``. Tensors in F32/F16/BF16 and every block
quantization `gguf.quants` can dequantize (Q4_0 ... Q8_0, the K-quants, IQ*).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from ..ops.files import atomic_write, atomic_write_bytes
from ..ops.runtime import mx
from .gguf_archs import ARCHITECTURES, GLOBAL_NAMES, Tensors, UnsupportedGGUFError, config_for

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
CONVERTER_VERSION = 1  # bump when the output of a conversion changes


def _supported_tensor_types() -> frozenset[str]:
    from gguf.quants import _type_traits  # the dequantizers gguf ships

    return frozenset({"F32", "F16", "BF16"} | {t.name for t in _type_traits})


# ---------------------------------------------------------------------------- names

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def mlx_name(architecture: str, gguf_name: str) -> str:
    """The mlx-lm parameter name of a GGUF tensor name.

    >>> mlx_name("llama", "blk.3.attn_q.weight")
    'model.layers.3.self_attn.q_proj.weight'
    >>> mlx_name("gemma3", "blk.0.ffn_norm.weight")
    'model.layers.0.pre_feedforward_layernorm.weight'
    >>> mlx_name("qwen3moe", "blk.1.ffn_up_exps.weight")
    'model.layers.1.mlp.switch_mlp.up_proj.weight'
    """
    spec = ARCHITECTURES[architecture]
    base, _, kind = gguf_name.partition(".")
    if base in spec.globals and kind == "weight":
        return f"{GLOBAL_NAMES[base]}.weight"
    m = _BLOCK_RE.match(gguf_name)
    if m is None or m.group(2) not in spec.layers:
        raise UnsupportedGGUFError(
            f"tensor {gguf_name!r} has no counterpart in mlx-lm's {spec.model_type} model; "
            f"this GGUF is not a plain {architecture} checkpoint"
        )
    layer, part, kind = m.groups()
    return f"model.layers.{layer}.{spec.layers[part]}.{kind}"


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of llama Q/K weights.

    llama.cpp's converter reorders each head's rows from the half-split RoPE layout of
    Hugging Face checkpoints to interleaved pairs: ``reshape(h, 2, d/2, ...)``, swap axes 1
    and 2. mlx-lm's llama uses the half-split layout, so we apply the inverse.
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ---------------------------------------------------------------------------- metadata


def _fields(reader: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith(prefix):
            out[key] = field.contents()
    return out


def _tokenizer_files(arch: str, meta: dict[str, Any], out: Path) -> list[int]:
    """Write tokenizer.json / tokenizer_config.json; return the end-of-sequence ids."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    tok: dict[str, Any] = {}
    tok_config: dict[str, Any] = {}
    for group, target in (("tokenizer", tok), ("tokenizer_config", tok_config)):
        for key, name in GGUF_TOKENIZER_MAPPING[group].items():
            if f"tokenizer.{key}" in meta:
                target[name] = meta[f"tokenizer.{key}"]
    if tok.get("tokenizer_type") == "llama":
        tok_config.setdefault("add_bos_token", True)  # llama.cpp's default for sentencepiece
    backend, _ = convert_gguf_tokenizer(arch, tok)
    tokens: list[str] = tok["tokens"]
    special = {
        "bos_token": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token": meta.get("tokenizer.ggml.eos_token_id"),
        "unk_token": meta.get("tokenizer.ggml.unknown_token_id"),
        "pad_token": meta.get("tokenizer.ggml.padding_token_id"),
    }
    if tok_config.get("add_bos_token") and special["bos_token"] is not None:
        # A fast tokenizer adds BOS only through its post-processor (Gemma degenerates without it).
        from tokenizers import processors

        bos_id = int(special["bos_token"])
        bos = tokens[bos_id]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    for name, idx in special.items():
        if idx is not None:
            tok_config[name] = tokens[int(idx)]
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_config["clean_up_tokenization_spaces"] = False
    _save_tokenizer(backend, tok_config, out)

    eos = [int(special["eos_token"])] if special["eos_token"] is not None else []
    # A chat turn ends with its own token (Gemma's 106, where text ends with 1; Qwen's <|im_end|>)
    end_of_turn = ARCHITECTURES[arch].end_of_turn
    if end_of_turn in tokens and tokens.index(end_of_turn) not in eos:
        eos.append(tokens.index(end_of_turn))
    return eos


def _save_tokenizer(backend: Any, tok_config: dict[str, Any], out: Path) -> None:
    """Write ``tokenizer.json`` (compact: Python parses it 30 % faster than indented, and
    mlx-lm parses it at every load) and ``tokenizer_config.json`` with the added tokens in
    ``added_tokens_decoder``, as transformers' ``save_pretrained`` writes them: without them
    transformers parses all of tokenizer.json in Python at every load to find them (~1 s
    of a Gemma 3 start, whose 262K-token vocabulary makes it 33 MB)."""
    tok_config = dict(tok_config)
    tok_config["added_tokens_decoder"] = {
        str(i): {
            "content": t.content,
            "lstrip": t.lstrip,
            "normalized": t.normalized,
            "rstrip": t.rstrip,
            "single_word": t.single_word,
            "special": t.special,
        }
        for i, t in sorted(backend.get_added_tokens_decoder().items())
    }
    atomic_write(out / "tokenizer.json", lambda tmp: backend.save(tmp, pretty=False))
    atomic_write_bytes(out / "tokenizer_config.json", json.dumps(tok_config, indent=2).encode())


def upgrade_tokenizer_files(model_dir: Path) -> bool:
    """Bring the tokenizer files of a directory converted by an earlier release up to
    ``_save_tokenizer``'s (once; True when it did). The tokenizer files are not part of the
    model's fingerprint: the caches made under that directory stay valid."""
    path = model_dir / "tokenizer_config.json"
    tok_config = json.loads(path.read_text())
    if "added_tokens_decoder" in tok_config:
        return False
    from tokenizers import Tokenizer

    _save_tokenizer(Tokenizer.from_file(str(model_dir / "tokenizer.json")), tok_config, model_dir)
    return True


# ---------------------------------------------------------------------------- conversion


def _tensor_array(tensor: Any) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    kind = tensor.tensor_type
    if kind in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        arr = np.asarray(tensor.data, dtype=np.float32)
    else:
        arr = dequantize(np.asarray(tensor.data), kind)
    # GGUF lists dimensions innermost first; numpy wants them outermost first.
    return arr.reshape([int(d) for d in reversed(tensor.shape.tolist())])


def convert_gguf(
    gguf_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    dtype: str = "float32",
    progress: Callable[[Iterable[Any], int, str], Iterable[Any]] | None = None,
) -> Path:
    """Convert ``gguf_path`` into an mlx-lm directory at ``out_dir`` (atomically: the
    directory appears complete or not at all). Returns ``out_dir``."""
    from gguf import GGUFReader

    src, out = Path(gguf_path), Path(out_dir)
    if not src.is_file():
        raise FileNotFoundError(f"GGUF file not found: {src}")
    try:
        reader = GGUFReader(src)
    except Exception as exc:  # the gguf package raises bare ValueErrors on junk
        raise UnsupportedGGUFError(f"{src} is not a readable GGUF file: {exc}") from exc
    meta = _fields(reader, "general.") | _fields(reader, "tokenizer.")
    arch = str(meta.get("general.architecture"))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedGGUFError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    meta |= _fields(reader, f"{arch}.")
    supported = _supported_tensor_types()
    bad = sorted({t.tensor_type.name for t in reader.tensors} - supported)
    if bad:
        raise UnsupportedGGUFError(
            f"GGUF tensor type(s) {', '.join(bad)} cannot be dequantized; "
            f"supported: {', '.join(sorted(supported))}"
        )

    spec = ARCHITECTURES[arch]
    names = {t.name for t in reader.tensors}
    values = {t.name: _tensor_array(t) for t in reader.tensors if t.name in spec.config_tensors}
    vocab = len(meta.get("tokenizer.ggml.tokens", []))
    config = config_for(arch, meta, Tensors(names, values), vocab)
    mx_dtype = getattr(mx, dtype)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        weights: dict[str, mx.array] = {}
        tensors: Iterable[Any] = reader.tensors
        if progress is not None:
            tensors = progress(tensors, len(reader.tensors), f"converting {src.name}")
        for t in tensors:
            if t.name in spec.config_tensors:  # already in config.json
                continue
            arr = _tensor_array(t)
            if spec.permuted_qk and t.name.endswith(("attn_q.weight", "attn_k.weight")):
                key = "num_attention_heads" if "attn_q" in t.name else "num_key_value_heads"
                arr = unpermute_qk(arr, config[key])
            if spec.norm_offset and t.name.endswith("norm.weight"):
                arr = arr - spec.norm_offset  # llama.cpp stores Gemma's RMSNorm scale as 1 + w
            weights[mlx_name(arch, t.name)] = mx.array(arr).astype(mx_dtype)
        config["eos_token_id"] = _tokenizer_files(arch, meta, tmp)
        config["converted_from"] = {"file": src.name, "converter_version": CONVERTER_VERSION, "dtype": dtype}
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        if out.exists():  # another process finished first: keep theirs
            shutil.rmtree(tmp)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
