"""The per-architecture half of the GGUF converter (``gguf_convert``).

For each GGUF architecture it converts: the mlx-lm family it becomes, which mlx-lm parameter
each llama.cpp tensor is (the names of ``gguf.constants.TENSOR_NAMES``; mlx-lm's are Hugging
Face's, except MoE experts, stacked under ``switch_mlp``), what llama.cpp's
``convert_hf_to_gguf.py`` did to the values on the way in (``gguf_convert`` undoes it), and how
the ``config.json`` is rebuilt from the metadata that converter writes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import UnsupportedGGUFError

# ---------------------------------------------------------------------------- names

#: Tensors outside the blocks; an architecture lists which of them it may have.
GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

# Block tensors (``blk.N.<name>``) -> the module under ``model.layers.N``, in groups.
_ATTENTION = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
# Phi-3 fuses q/k/v into one matrix and gate/up into another; llama.cpp keeps both fused, in
# Hugging Face's row order (q, k, v; gate, then up), which is mlx-lm's: no split needed.
_PHI3 = {
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_up": "mlp.gate_up_proj",
    "ffn_down": "mlp.down_proj",
}
# llama.cpp stacks a layer's experts into one 3-D tensor per projection, (experts, out, in):
# the layout of mlx-lm's SwitchGLU.
_EXPERTS = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
}
_TWO_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
# Gemma normalizes before and after both attention and MLP; llama.cpp calls the norm before
# the MLP ``ffn_norm``, the llama name of another module.
_GEMMA_NORMS = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


# ---------------------------------------------------------------------------- config


class Meta:
    """The ``{arch}.*`` metadata of a GGUF, by the key after the prefix."""

    def __init__(self, arch: str, meta: Mapping[str, Any]) -> None:
        self.arch, self._meta = arch, meta

    def get(self, key: str, default: Any = None) -> Any:
        return self._meta.get(f"{self.arch}.{key}", default)

    def need(self, key: str, *fallbacks: str) -> Any:
        """The value of ``key``, else of the first of ``fallbacks`` the file has; refuses
        the file if it has none of them."""
        for k in (key, *fallbacks):
            if (value := self.get(k)) is not None:
                return value
        raise UnsupportedGGUFError(f"the GGUF has no {self.arch}.{key}, which its architecture needs")


@dataclass(frozen=True)
class Tensors:
    """What a config builder may read of a GGUF's tensors."""

    names: Collection[str]
    #: The values of the architecture's ``config_tensors`` the file has (dequantized).
    values: Mapping[str, np.ndarray]


ConfigBuilder = Callable[[Meta, dict[str, Any], Tensors], dict[str, Any]]


def _tied(tensors: Tensors) -> dict[str, Any]:
    # llama.cpp writes the output projection only when it is not the embedding matrix
    return {"tie_word_embeddings": "output.weight" not in tensors.names}


def _refuse_rope_scaling(m: Meta, why: str = "") -> None:
    kind = m.get("rope.scaling.type")
    if kind not in (None, "none"):
        raise UnsupportedGGUFError(f"RoPE scaling {kind!r} is not supported yet{why}")


def _rope_scaling(m: Meta) -> dict[str, Any]:
    """``{"rope_scaling": ...}`` for the linear or YaRN scaling llama.cpp's converter writes
    as metadata (``{}`` without any), as mlx-lm's ``initialize_rope`` reads it."""
    kind = m.get("rope.scaling.type")
    if kind in (None, "none"):
        return {}
    if kind not in ("linear", "yarn"):
        raise UnsupportedGGUFError(f"RoPE scaling {kind!r} is not supported yet for {m.arch}")
    factor = float(m.need("rope.scaling.factor"))
    if kind == "linear":
        return {"rope_scaling": {"type": "linear", "factor": factor}}
    # mlx-lm's YaRN is Hugging Face's default one: the attention factor derived from the scale
    # (llama.cpp's extra multiplier 1) and the full ramp mix (its extrapolation factor 1); a
    # file stating other values would run otherwise.
    stated = (m.get("rope.scaling.yarn_attn_factor", 1.0), m.get("rope.scaling.yarn_ext_factor", 1.0))
    if stated != (1.0, 1.0):
        raise UnsupportedGGUFError(
            f"YaRN with (attention, extrapolation) factors {stated} is not supported yet"
        )
    scaling = {
        "type": "yarn",
        "factor": factor,
        "original_max_position_embeddings": int(m.need("rope.scaling.original_context_length")),
    }
    for beta in ("beta_fast", "beta_slow"):
        if (value := m.get(f"rope.scaling.yarn_{beta}")) is not None:
            scaling[beta] = float(value)
    return {"rope_scaling": scaling}


def _head_dim(m: Meta, common: dict[str, Any], *, derived: bool = False) -> int:
    """The attention head width (``key_length``, which llama.cpp writes where the checkpoint
    states one). With ``derived``, for a family that computes it as hidden / heads and can
    take no other. Refuses partial rotary (``rope.dimension_count`` short of the head), which
    the families using this have not."""
    natural = common["hidden_size"] // common["num_attention_heads"]
    width = int(m.get("attention.key_length", natural))
    if derived and width != natural:
        raise UnsupportedGGUFError(f"head width {width} is not hidden/heads ({natural}) for {m.arch}")
    rotary = int(m.get("rope.dimension_count", width))
    if rotary != width:
        raise UnsupportedGGUFError(f"RoPE on {rotary} of {width} head dims is not supported for {m.arch}")
    return width


def _llama(m: Meta, common: dict[str, Any], tensors: Tensors) -> dict[str, Any]:
    _refuse_rope_scaling(m)
    head_dim = int(m.get("attention.key_length", common["hidden_size"] // common["num_attention_heads"]))
    return {"model_type": "llama", **common, "head_dim": head_dim, **_tied(tensors)}


def _gemma3(m: Meta, common: dict[str, Any], tensors: Tensors) -> dict[str, Any]:
    # The GGUF lacks the sliding-window pattern, the local RoPE base and the query scale;
    # these are the values of every released Gemma 3 text model of <=12B (head_dim 256).
    _refuse_rope_scaling(m)
    head_dim = int(m.get("attention.key_length", 256))
    return {
        "model_type": "gemma3_text",
        **common,
        "head_dim": head_dim,
        "query_pre_attn_scalar": head_dim,
        "sliding_window": int(m.get("attention.sliding_window", 512)),
        "sliding_window_pattern": 6,
        "rope_local_base_freq": 10000.0,
    }


def _qwen2(m: Meta, common: dict[str, Any], tensors: Tensors) -> dict[str, Any]:
    _head_dim(m, common, derived=True)
    return {"model_type": "qwen2", **common, **_tied(tensors), **_rope_scaling(m)}


def _qwen3(m: Meta, common: dict[str, Any], tensors: Tensors) -> dict[str, Any]:
    head_dim = _head_dim(m, common)
    return {"model_type": "qwen3", **common, "head_dim": head_dim, **_tied(tensors), **_rope_scaling(m)}


def _qwen3moe(m: Meta, common: dict[str, Any], tensors: Tensors) -> dict[str, Any]:
    _refuse_rope_scaling(m, ": mlx-lm's qwen3_moe applies none")
    return {
        "model_type": "qwen3_moe",
        **common,
        "head_dim": _head_dim(m, common),
        **_tied(tensors),
        "num_experts": int(m.need("expert_count")),
        "num_experts_per_tok": int(m.need("expert_used_count")),
        "moe_intermediate_size": int(m.need("expert_feed_forward_length")),
        # llama.cpp's qwen3moe has experts on every layer and renormalizes the top-k weights
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": bool(m.get("expert_weights_norm", True)),
    }


def _phi3(m: Meta, common: dict[str, Any], tensors: Tensors) -> dict[str, Any]:
    head_dim = common["hidden_size"] // common["num_attention_heads"]  # mlx-lm's phi3 derives it
    if int(m.get("attention.key_length", head_dim)) != head_dim:
        raise UnsupportedGGUFError(f"head width is not hidden/heads ({head_dim}) for phi3")
    if m.get("rope.scaling.type") not in (None, "none", "longrope"):  # LongRoPE's factors are tensors
        raise UnsupportedGGUFError(
            f"RoPE scaling {m.get('rope.scaling.type')!r} is not supported yet for phi3"
        )
    config = {
        "model_type": "phi3",
        **common,
        # Phi-4-mini rotates 3/4 of each head; llama.cpp states it as a dimension count
        "partial_rotary_factor": int(m.get("rope.dimension_count", head_dim)) / head_dim,
        "original_max_position_embeddings": int(
            m.get("rope.scaling.original_context_length", common["max_position_embeddings"])
        ),
        **_tied(tensors),
    }
    if "rope_factors_long.weight" in tensors.values:
        config["rope_scaling"] = _longrope(m, config, tensors)
    return config


def _longrope(m: Meta, config: dict[str, Any], tensors: Tensors) -> dict[str, Any]:
    """Phi-3's LongRoPE factors, which llama.cpp writes as two tensors, as mlx-lm's
    ``rope_scaling``. mlx-lm's ``SuScaledRoPE`` derives the attention factor from the two
    context lengths as LongRoPE does; a file stating another (YaRN's) would run otherwise."""
    if "rope_factors_short.weight" not in tensors.values:
        raise UnsupportedGGUFError("the GGUF has rope_factors_long but no rope_factors_short")
    original = config["original_max_position_embeddings"]
    scale = config["max_position_embeddings"] / original
    derived = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
    stated = m.get("rope.scaling.attn_factor")
    if stated is not None and not math.isclose(float(stated), derived, rel_tol=1e-4):
        raise UnsupportedGGUFError(f"RoPE attention factor {stated} is not LongRoPE's {derived:.6f}")
    return {
        "type": "longrope",
        "long_factor": tensors.values["rope_factors_long.weight"].tolist(),
        "short_factor": tensors.values["rope_factors_short.weight"].tolist(),
    }


def _gemma2(m: Meta, common: dict[str, Any], tensors: Tensors) -> dict[str, Any]:
    _refuse_rope_scaling(m)
    head_dim = int(m.get("attention.key_length", 256))
    # The GGUF lacks the query scale; llama.cpp picks it by model size: hidden/heads for
    # Gemma 2 27B (46 layers: 144, where its heads are 128 wide), the head width otherwise.
    is_27b = common["num_hidden_layers"] == 46
    scalar = common["hidden_size"] // common["num_attention_heads"] if is_27b else head_dim
    return {
        "model_type": "gemma2",
        **common,
        "head_dim": head_dim,
        "query_pre_attn_scalar": scalar,
        # llama.cpp's defaults where the file states none, which are Gemma 2's own
        "attn_logit_softcapping": float(m.get("attn_logit_softcapping", 50.0)),
        "final_logit_softcapping": float(m.get("final_logit_softcapping", 30.0)),
    }


# ---------------------------------------------------------------------------- table


@dataclass(frozen=True)
class Architecture:
    """What converting a GGUF architecture into its mlx-lm family takes."""

    #: mlx-lm's ``model_type`` (its module of ``mlx_lm.models``).
    model_type: str
    #: Block tensor name -> mlx-lm module under ``model.layers.N``.
    layers: Mapping[str, str]
    #: ``config.json`` from the metadata: ``(metadata, the keys all families share, tensors)``.
    config: ConfigBuilder
    #: Which of ``GLOBAL_NAMES`` a file may hold (Gemma 2 always ties its output to the embedding).
    globals: frozenset[str] = frozenset(GLOBAL_NAMES)
    #: llama.cpp permuted the Q/K rows (llama only: the other families use NeoX-style RoPE,
    #: Hugging Face's half-split layout, and llama.cpp writes them unpermuted).
    permuted_qk: bool = False
    #: llama.cpp stored each RMSNorm scale as ``norm_offset + w`` (Gemma multiplies by 1 + w).
    norm_offset: float = 0.0
    #: The token that ends a chat turn: a second end-of-sequence id where the vocabulary has it.
    end_of_turn: str | None = None
    #: Tensors that are configuration, not weights: read into ``config.json`` only.
    config_tensors: frozenset[str] = frozenset()


ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture("llama", {**_ATTENTION, **_MLP, **_TWO_NORMS}, _llama, permuted_qk=True),
    "gemma3": Architecture(
        "gemma3_text",
        {**_ATTENTION, **_QK_NORMS, **_MLP, **_GEMMA_NORMS},
        _gemma3,
        norm_offset=1.0,
        end_of_turn="<end_of_turn>",
    ),
    # Qwen 2's q/k/v biases are ``blk.N.attn_q.bias`` etc.: the same names, kind ``bias``.
    "qwen2": Architecture("qwen2", {**_ATTENTION, **_MLP, **_TWO_NORMS}, _qwen2, end_of_turn="<|im_end|>"),
    "qwen3": Architecture(
        "qwen3", {**_ATTENTION, **_QK_NORMS, **_MLP, **_TWO_NORMS}, _qwen3, end_of_turn="<|im_end|>"
    ),
    "qwen3moe": Architecture(
        "qwen3_moe",
        {**_ATTENTION, **_QK_NORMS, **_EXPERTS, **_TWO_NORMS},
        _qwen3moe,
        end_of_turn="<|im_end|>",
    ),
    "phi3": Architecture(
        "phi3",
        {**_PHI3, **_TWO_NORMS},
        _phi3,
        end_of_turn="<|end|>",
        config_tensors=frozenset({"rope_factors_long.weight", "rope_factors_short.weight"}),
    ),
    "gemma2": Architecture(
        "gemma2",
        {**_ATTENTION, **_MLP, **_GEMMA_NORMS},
        _gemma2,
        globals=frozenset({"token_embd", "output_norm"}),
        norm_offset=1.0,
        end_of_turn="<end_of_turn>",
    ),
}


def config_for(arch: str, meta: Mapping[str, Any], tensors: Tensors, vocab: int) -> dict[str, Any]:
    """The mlx-lm ``config.json`` of a GGUF of ``arch`` (less its end-of-sequence ids), from
    its metadata and ``vocab``, the length of its token list."""
    m = Meta(arch, meta)
    heads = int(m.need("attention.head_count"))
    common = {
        "hidden_size": int(m.need("embedding_length")),
        "num_hidden_layers": int(m.need("block_count")),
        # a file whose every layer is MoE may state only the experts' width
        "intermediate_size": int(m.need("feed_forward_length", "expert_feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(m.get("attention.head_count_kv", heads)),
        "rms_norm_eps": float(m.need("attention.layer_norm_rms_epsilon")),
        "vocab_size": int(m.get("vocab_size", vocab)),
        "rope_theta": float(m.get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(m.get("context_length", 2048)),
    }
    return ARCHITECTURES[arch].config(m, common, tensors)
