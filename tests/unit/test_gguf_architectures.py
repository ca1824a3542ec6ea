"""Every GGUF architecture the converter supports, end to end: a small random-weight mlx-lm
model is written as a GGUF the way llama.cpp's ``convert_hf_to_gguf.py`` writes one (names
through the `gguf` package's own tensor map, llama.cpp's value transforms and metadata, F16
and Q8_0 tensors, a tokenizer of the file's kind), converted with ``convert_gguf``, and the
converted model's logits compared with the original's (whose weights carry the same F16 /
Q8_0 rounding, so the comparison is tight)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter

from langchain_agent_memory.engine.model.gguf_archs import ARCHITECTURES, Tensors, config_for
from langchain_agent_memory.engine.model.gguf_convert import UnsupportedGGUFError, convert_gguf, mlx_name
from langchain_agent_memory.engine.ops.runtime import mx  # before mlx-lm: the process's BLAS
from langchain_agent_memory.testing.family_configs import family_config

F16, Q8_0 = GGMLQuantizationType.F16, GGMLQuantizationType.Q8_0
TOKEN_IDS = [3, 17, 101, 250, 42, 7, 199]


# ---------------------------------------------------------------------------- tokenizers


@dataclasses.dataclass(frozen=True)
class Vocab:
    """A small tokenizer, as GGUF metadata."""

    model: str  # tokenizer.ggml.model
    pre: str
    tokens: list[str]
    types: list[int]  # 1 normal, 2 unknown, 3 control, 6 byte
    scores: list[float] | None
    merges: list[str] | None
    bos: int
    eos: int
    add_bos: bool


def _byte_level(pre: str, specials: list[str], *, add_bos: bool = False) -> Vocab:
    """A byte-level BPE vocabulary (Qwen's, Llama 3's kind): the 256 byte characters, a few
    merges, then the special tokens."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"]
    tokens = list(bytes_to_unicode().values()) + [m.replace(" ", "") for m in merges] + specials
    types = [1] * (len(tokens) - len(specials)) + [3] * len(specials)
    eos = tokens.index(specials[0])
    return Vocab("gpt2", pre, tokens, types, None, merges, eos, eos, add_bos)


def _sentencepiece(end_of_turn: str, *, add_bos: bool) -> Vocab:
    """A sentencepiece vocabulary (Gemma's, Phi-3's kind): unk/bos/eos, 256 byte fallbacks,
    pieces best-first, then the end-of-turn token."""
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "hell", "hello"]
    pieces += ["▁hello", "or", "▁w", "▁wor", "ld", "▁world"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces, end_of_turn]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces) + [3]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))] + [0.0]
    return Vocab("llama", "default", tokens, types, scores, None, 1, 2, add_bos)


# ---------------------------------------------------------------------------- cases


@dataclasses.dataclass(frozen=True)
class Case:
    arch: str  # GGUF architecture
    family: str  # mlx-lm family, for its small config
    vocab: Vocab
    matrices: GGMLQuantizationType  # the type of every tensor of 2+ dimensions
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)


QWEN = _byte_level("qwen2", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
_PHI3_ROTARY = 48  # 3/4 of a 64-wide head, as Phi-4-mini
CASES = {
    "qwen2": Case("qwen2", "qwen2", QWEN, Q8_0),
    "qwen2-yarn": Case(
        "qwen2",
        "qwen2",
        QWEN,
        F16,
        {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}},
    ),
    "qwen3": Case("qwen3", "qwen3", QWEN, Q8_0),
    "qwen3-linear": Case("qwen3", "qwen3", QWEN, F16, {"rope_scaling": {"type": "linear", "factor": 2.0}}),
    "qwen3moe": Case("qwen3moe", "qwen3_moe", QWEN, Q8_0),
    "phi3": Case("phi3", "phi3", _sentencepiece("<|end|>", add_bos=False), F16),
    "phi3-longrope": Case(
        "phi3",
        "phi3",
        _sentencepiece("<|end|>", add_bos=False),
        Q8_0,
        {
            "partial_rotary_factor": _PHI3_ROTARY / 64,
            "tie_word_embeddings": True,
            "max_position_embeddings": 16384,
            "original_max_position_embeddings": 4096,
            "rope_scaling": {
                "type": "longrope",
                "long_factor": np.linspace(1.0, 8.0, _PHI3_ROTARY // 2).tolist(),
                "short_factor": np.linspace(1.0, 1.5, _PHI3_ROTARY // 2).tolist(),
            },
        },
    ),
    # Gemma 2 2B/9B's query scale (the head width); soft caps far from the defaults, so the
    # converter has to read them from the metadata for the logits to match
    "gemma2": Case(
        "gemma2",
        "gemma2",
        _sentencepiece("<end_of_turn>", add_bos=True),
        Q8_0,
        {"query_pre_attn_scalar": 64, "attn_logit_softcapping": 0.5, "final_logit_softcapping": 0.2},
    ),
    # the two architectures supported before, as regressions (llama's Q/K rows permuted)
    "llama": Case(
        "llama",
        "llama",
        _byte_level("llama-bpe", ["<|end_of_text|>"], add_bos=True),
        Q8_0,
        {"rope_scaling": None},
    ),
    "gemma3": Case(
        "gemma3",
        "gemma3_text",
        _sentencepiece("<end_of_turn>", add_bos=True),
        F16,
        # what the converter assumes of every Gemma 3 GGUF: five sliding layers, then a full one
        {
            "num_hidden_layers": 6,
            "sliding_window": 512,
            "sliding_window_pattern": 6,
            "rope_local_base_freq": 10000.0,
        },
    ),
}


# ---------------------------------------------------------------------------- the model


def _model(case: Case) -> tuple[Any, dict[str, Any]]:
    """The family's small model with random weights, over ``case.vocab``; norm scales and
    biases moved off their initial 1 / 0, so a wrong offset or a dropped vector shows."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    config = {**family_config(case.family), **case.overrides, "vocab_size": len(case.vocab.tokens)}
    model_class, args_class = _get_classes(config)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(config))
    rng = np.random.default_rng(0)
    moved = [
        (name, value + mx.array(rng.normal(0.0, 0.1, value.shape).astype(np.float32)))
        for name, value in tree_flatten(model.parameters())
        if value.ndim == 1
    ]
    model.load_weights(moved, strict=False)
    return model, config


def _stored(value: np.ndarray, kind: GGMLQuantizationType) -> np.ndarray:
    """``value`` as a GGUF tensor of ``kind`` holds it: F32 stays, F16 is cast, the rest
    quantized (raw blocks)."""
    if value.ndim == 1:
        return value.astype(np.float32)  # llama.cpp keeps vectors (norms, biases) F32
    if kind == F16:
        return value.astype(np.float16)
    return gguf.quants.quantize(value, kind)


def _rounded(value: np.ndarray, kind: GGMLQuantizationType) -> np.ndarray:
    stored = _stored(value, kind)
    if stored.dtype == np.uint8:
        return gguf.quants.dequantize(stored, kind).reshape(value.shape)
    return stored.astype(np.float32)


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp convert_hf_to_gguf.py LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama_cpp_tensor(arch: str, gguf_name: str, value: np.ndarray, config: dict[str, Any]) -> np.ndarray:
    """What llama.cpp's converter does to a tensor's values before it writes it."""
    if arch == "llama" and gguf_name.endswith("attn_q.weight"):
        return _llama_cpp_permute(value, config["num_attention_heads"])
    if arch == "llama" and gguf_name.endswith("attn_k.weight"):
        return _llama_cpp_permute(value, config["num_key_value_heads"])
    if arch in ("gemma2", "gemma3") and gguf_name.endswith("norm.weight"):
        return value + 1.0
    return value


# ---------------------------------------------------------------------------- the GGUF


def _write_metadata(w: GGUFWriter, arch: str, args: Any) -> None:
    """The hyperparameters llama.cpp's converter writes for ``arch`` (``args``: the model's
    ``ModelArgs``, defaults included)."""
    w.add_block_count(args.num_hidden_layers)
    w.add_context_length(getattr(args, "max_position_embeddings", 4096))
    w.add_embedding_length(args.hidden_size)
    w.add_feed_forward_length(args.intermediate_size)
    w.add_head_count(args.num_attention_heads)
    w.add_head_count_kv(args.num_key_value_heads)
    w.add_layer_norm_rms_eps(args.rms_norm_eps)
    if arch != "gemma2":  # Gemma 2's converter writes no RoPE base (10000)
        w.add_rope_freq_base(args.rope_theta)
    if getattr(args, "head_dim", None) is not None:
        w.add_key_length(args.head_dim)
        w.add_value_length(args.head_dim)
    if arch == "llama":
        w.add_rope_dimension_count(args.head_dim)
    scaling = getattr(args, "rope_scaling", None) or {}
    if scaling.get("type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(scaling["factor"])
    elif scaling.get("type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(scaling["factor"])
        w.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
    if arch == "qwen3moe":
        w.add_expert_count(args.num_experts)
        w.add_expert_used_count(args.num_experts_per_tok)
        w.add_expert_feed_forward_length(args.moe_intermediate_size)
    if arch == "phi3":
        w.add_rope_dimension_count(
            int(args.partial_rotary_factor * args.hidden_size) // args.num_attention_heads
        )
        w.add_rope_scaling_orig_ctx_len(args.original_max_position_embeddings)
        w.add_sliding_window(0)
        if scaling:
            scale = args.max_position_embeddings / args.original_max_position_embeddings
            w.add_rope_scaling_attn_factors(
                float(np.sqrt(1 + np.log(scale) / np.log(args.original_max_position_embeddings)))
            )
    if arch == "gemma2":
        w.add_attn_logit_softcapping(args.attn_logit_softcapping)
        w.add_final_logit_softcapping(args.final_logit_softcapping)
        w.add_sliding_window(4096)


def _write_vocab(w: GGUFWriter, vocab: Vocab) -> None:
    w.add_tokenizer_model(vocab.model)
    w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.types)
    if vocab.scores is not None:
        w.add_token_scores(vocab.scores)
    if vocab.merges is not None:
        w.add_token_merges(vocab.merges)
    w.add_bos_token_id(vocab.bos)
    w.add_eos_token_id(vocab.eos)
    w.add_add_bos_token(vocab.add_bos)


def _write_gguf(path: Path, case: Case) -> Any:
    """Write ``case``'s model as llama.cpp would; return the model, its weights rounded as
    the file stores them."""
    from mlx.utils import tree_flatten

    model, config = _model(case)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[case.arch.upper()], config["num_hidden_layers"])
    w = GGUFWriter(str(path), case.arch)
    _write_metadata(w, case.arch, model.args)
    _write_vocab(w, case.vocab)
    rounded = []
    for name, value in tree_flatten(model.parameters()):
        # Hugging Face's name, which llama.cpp maps: mlx-lm stacks the experts under switch_mlp
        gguf_name = names.get_name(
            name.replace(".switch_mlp.", ".experts."), try_suffixes=(".weight", ".bias")
        )
        assert gguf_name is not None, name
        array = np.array(value)
        stored = _stored(_llama_cpp_tensor(case.arch, gguf_name, array, config), case.matrices)
        w.add_tensor(gguf_name, stored, raw_dtype=case.matrices if stored.dtype == np.uint8 else None)
        rounded.append((name, mx.array(_rounded(array, case.matrices))))
    scaling = config.get("rope_scaling") or {}
    if scaling.get("type") == "longrope":  # llama.cpp writes Phi-3's factors as tensors
        for kind in ("long", "short"):
            w.add_tensor(f"rope_factors_{kind}.weight", np.array(scaling[f"{kind}_factor"], dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    model.load_weights(rounded)
    return model


# ---------------------------------------------------------------------------- tests


@pytest.mark.parametrize("case_name", list(CASES))
def test_converted_model_computes_the_original_logits(case_name: str, tmp_path: Path) -> None:
    from mlx_lm.utils import load_model
    from tokenizers import Tokenizer

    case = CASES[case_name]
    original = _write_gguf(tmp_path / "m.gguf", case)
    out = convert_gguf(tmp_path / "m.gguf", tmp_path / "out")

    converted, config = load_model(out)  # strict: every parameter present, none left over
    assert config["model_type"] == ARCHITECTURES[case.arch].model_type
    ids = mx.array([TOKEN_IDS])
    expected, got = np.array(original(ids)), np.array(converted(ids))
    assert np.abs(expected).max() > 0.05  # logits worth comparing
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)

    # the file's end of sequence, then the end of a chat turn where the vocabulary has one
    tokens, end_of_turn = case.vocab.tokens, ARCHITECTURES[case.arch].end_of_turn
    turn = [tokens.index(end_of_turn)] if end_of_turn in tokens else []
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == [case.vocab.eos, *turn]
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tokenizer.decode(tokenizer.encode("hello world", add_special_tokens=False).ids) == "hello world"


def test_every_mapped_name_is_one_of_the_gguf_packages_names() -> None:
    """The tables name only tensors the `gguf` package lists for the architecture."""
    for arch, spec in ARCHITECTURES.items():
        listed = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH[arch.upper()]]}
        ours = {f"blk.{{bid}}.{part}" for part in spec.layers} | set(spec.globals)
        ours |= {name.removesuffix(".weight") for name in spec.config_tensors}
        assert ours <= listed, (arch, ours - listed)


def _meta(arch: str, **values: Any) -> dict[str, Any]:
    base = {
        "attention.head_count": 8,
        "attention.head_count_kv": 2,
        "embedding_length": 512,
        "block_count": 2,
        "feed_forward_length": 1024,
        "attention.layer_norm_rms_epsilon": 1e-6,
    }
    return {f"{arch}.{k}": v for k, v in {**base, **values}.items()}


def _config(arch: str, **values: Any) -> dict[str, Any]:
    return config_for(arch, _meta(arch, **values), Tensors(set(), {}), 100)


def test_gemma2_27b_scales_queries_by_hidden_over_heads() -> None:
    """llama.cpp picks Gemma 2's query scale by size: 27B (46 layers) hidden/heads."""
    sizes = {"embedding_length": 4608, "attention.head_count": 32, "attention.key_length": 128}
    assert _config("gemma2", block_count=46, **sizes)["query_pre_attn_scalar"] == 144
    assert _config("gemma2", block_count=42, **sizes)["query_pre_attn_scalar"] == 128


_YARN = {
    "rope.scaling.type": "yarn",
    "rope.scaling.factor": 4.0,
    "rope.scaling.original_context_length": 32768,
}


def test_yarn_with_llama_cpps_neutral_factors_is_hugging_faces() -> None:
    neutral = {"rope.scaling.yarn_attn_factor": 1.0, "rope.scaling.yarn_ext_factor": 1.0}
    expected = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "beta_fast": 32.0}
    assert (
        _config("qwen3", **_YARN, **neutral, **{"rope.scaling.yarn_beta_fast": 32})["rope_scaling"]
        == expected
    )


@pytest.mark.parametrize(
    ("arch", "values", "match"),
    [
        ("qwen3moe", {"rope.scaling.type": "yarn", "expert_count": 4}, "qwen3_moe applies none"),
        ("qwen2", {"rope.dimension_count": 32}, "RoPE on 32 of 64"),
        ("qwen2", {"attention.key_length": 128}, "not hidden/heads"),
        ("qwen3", {**_YARN, "rope.scaling.yarn_attn_factor": 1.2}, "YaRN with"),
        ("qwen3", {**_YARN, "rope.scaling.yarn_ext_factor": 0.0}, "YaRN with"),
        ("qwen2", {"rope.scaling.type": "longrope"}, "'longrope' is not supported yet for qwen2"),
        ("gemma2", {"rope.scaling.type": "linear"}, "'linear'"),
        ("qwen3moe", {"expert_used_count": 2}, "qwen3moe.expert_count"),
    ],
)
def test_what_mlx_lm_cannot_run_is_refused(arch: str, values: dict[str, Any], match: str) -> None:
    with pytest.raises(UnsupportedGGUFError, match=match):
        _config(arch, **values)


def test_phi3_yarn_attention_factor_is_refused() -> None:
    factors = {name: np.ones(32, dtype=np.float32) for name in ARCHITECTURES["phi3"].config_tensors}
    meta = _meta(
        "phi3",
        context_length=131072,
        **{"rope.scaling.original_context_length": 4096, "rope.scaling.attn_factor": 1.35},
    )
    with pytest.raises(UnsupportedGGUFError, match="not LongRoPE's"):
        config_for("phi3", meta, Tensors(set(factors), factors), 100)


def test_gemma2_has_no_output_projection() -> None:
    with pytest.raises(UnsupportedGGUFError, match="no counterpart"):
        mlx_name("gemma2", "output.weight")
