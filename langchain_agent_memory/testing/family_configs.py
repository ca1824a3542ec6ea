"""Small random-weight configs for every text-model family the installed mlx-lm has.

Each family's config is generated from its own ``ModelArgs`` dataclass: generic small values
by field name (a width of 128, heads 64 wide, four layers, 4 experts with 2 active, a 48-token
sliding window), plus per-family overrides only where a field has no usable default. So a new
mlx-lm release brings its new families into the test matrix by itself, and a family whose
arguments changed shows up in ``unbuildable()`` with the reason instead of being skipped
silently. Families with hand-written configs (``SMALL_CONFIGS``, ``HYBRID_CONFIGS``) use them.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib
import inspect
import io
import pkgutil
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from ..engine.ops.runtime import mx  # before mlx-lm: the process's BLAS (runtime.py)
from .hybrid_configs import HYBRID_CONFIGS
from .random_model import SMALL_CONFIGS

_VOCAB = 49152  # SmolLM2's tokenizer, which write_random_model copies
_LAYERS = 4  # room for two layer kinds twice (sliding / full, recurrent / attention)
_HAND: dict[str, dict[str, Any]] = {**SMALL_CONFIGS, **HYBRID_CONFIGS}


def _each(names: str, value: Any) -> dict[str, Any]:
    return dict.fromkeys(names.split(), value)


#: Sizes by field name, set over the family's defaults (which are the published, large ones).
_SIZES: dict[str, Any] = {
    **_each("hidden_size d_model n_embd model_dim hidden_dim block_dim", 128),
    **_each("num_hidden_layers num_layers n_layers n_layer num_transformer_layers", _LAYERS),
    **_each("intermediate_size intermediate_size_mlp dense_intermediate_size ffn_hidden_size", 256),
    **_each("n_inner ff_intermediate_size block_ff_dim", 256),
    **_each("moe_intermediate_size expert_ffn_hidden_size moe_hidden_size share_expert_dim", 64),
    **_each("shared_expert_intermediate_size moe_shared_expert_intermediate_size", 64),
    **_each("shared_intermediate_size", 64),
    **_each("num_attention_heads n_head n_heads num_heads swa_num_attention_heads", 2),
    **_each("num_key_value_heads n_kv_heads num_kv_heads num_attention_groups", 1),
    **_each("swa_num_key_value_heads num_global_key_value_heads", 1),
    # every attention head 64 wide; MLA: 64-wide latent, rope, nope and value parts
    **_each("head_dim hidden_size_per_head kv_channels global_head_dim swa_head_dim", 64),
    **_each("v_head_dim swa_v_head_dim qk_nope_head_dim qk_rope_head_dim", 64),
    **_each("kv_lora_rank q_lora_rank o_lora_rank index_head_dim", 64),
    **_each("index_n_heads", 2),
    **_each("index_topk", 64),  # sparse-attention indexers pick 64 of the ~300 prompt tokens
    **_each("vocab_size num_vocab vocab_size_per_layer_input", _VOCAB),
    **_each("rms_norm_eps layer_norm_eps norm_eps layer_norm_epsilon norm_epsilon", 1e-6),
    **_each("layernorm_epsilon post_norm_eps", 1e-6),
    **_each("rope_theta rotary_emb_base rope_embedding_base rope_freq_constant swa_rope_theta", 10000.0),
    **_each("max_position_embeddings n_positions n_ctx block_size model_max_length", 4096),
    **_each("num_experts num_local_experts n_routed_experts moe_num_experts", 4),
    **_each("num_experts_per_tok moe_topk moe_k moe_top_k num_experts_per_token top_k_experts", 2),
    **_each("n_shared_experts num_shared_experts num_shared_expert moe_num_shared_experts", 1),
    **_each("n_group topk_group num_expert_group", 1),  # one expert group of the 4
    **_each("sliding_window sliding_window_size attention_window_size window_size loop_window_size", 48),
    "sliding_window_pattern": 2,  # one sliding layer, one full layer, twice
    **_each("num_kv_shared_layers num_kv_reuse_layers", 2),  # the last two layers reuse KV
    **_each("hidden_size_per_layer_input", 64),
    **_each("rotary_dim", 32),
    **_each("linear_num_key_heads", 2),
    **_each("linear_num_value_heads", 4),
    **_each("linear_key_head_dim linear_value_head_dim", 64),
    **_each("mamba_num_heads mamba_n_heads", 4),
    **_each("mamba_d_state state_size", 16),
}

#: Values for fields that have no default at all (flags, factors, kernel sizes), by field name.
_FILL: dict[str, Any] = {
    **_each("attention_bias mlp_bias use_bias use_qkv_bias post_norm conv_bias use_expert_bias", False),
    **_each("mamba_proj_bias linear_allow_neg_eigval", False),
    **_each("add_full_attention_sink_bias", False),
    # an lm_head of its own, as most published models (Qwen3-VL-MoE's sanitize needs one)
    **_each("tie_word_embeddings", False),
    **_each("norm_topk_prob use_conv_bias block_auto_adjust_ff_dim", True),
    **_each("qk_norm use_qk_norm use_cla add_swa_attention_sink_bias altup_correct_scale", True),
    **_each("mla_scale_q_lora mla_scale_kv_lora use_mixed_mlp_moe", True),
    **_each("routed_scaling_factor partial_rotary_factor block_ffn_dim_multiplier output_multiplier", 1.0),
    **_each("first_k_dense_replace num_dense_layers moe_layer_freq decoder_sparse_step", 1),
    **_each("layer_group_size group_norm_size cla_share_factor n_groups", 2),
    **_each("conv_kernel conv1d_width mamba_d_conv linear_conv_kernel_dim altup_num_inputs", 4),
    **_each("conv_window", 2),
    **_each("conv_L_cache", 3),
    **_each("mamba_expand", 2),
    **_each("a_low_rank_dim v_low_rank_dim gate_low_rank_dim decay_low_rank_dim", 32),
    **_each("laurel_rank dim_model_base", 64),
    **_each("final_logit_softcapping logits_soft_cap altup_coef_clip", 30.0),
    "mlp_only_layers": [],
    "rope_scaling": None,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "rope_local_base_freq": 10000.0,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "block_multiple_of": 256,
    "time_step_rank": "auto",
    "time_step_limit": [0.001, 100.0],
    "rotary_pct": 0.25,
    "hidden_act": "relu2",  # Nemotron's
    "gegelu_limit": 20.0,
    "altup_active_idx": 0,
    # Granite's published multipliers
    "embedding_multiplier": 12.0,
    "attention_multiplier": 0.015625,
    "residual_multiplier": 0.22,
    "logits_scaling": 8.0,
    # MiniCPM's
    "scale_depth": 1.4,
    "scale_emb": 12.0,
}

_SLIDING, _FULL = "sliding_attention", "full_attention"
# Llama 4's attention scaling by position, which Ministral 3 and Mistral 4 read from here.
_LLAMA4_ROPE = {
    "rope_type": "default",
    "rope_theta": 10000.0,
    "llama_4_scaling_beta": 0.1,
    "original_max_position_embeddings": 4096,
}
_ROPE_BY_LAYER_TYPE = {t: {"rope_type": "default", "rope_theta": 10000.0} for t in (_SLIDING, _FULL)}

# MLA whose cache holds the expanded keys: their nope and rope parts make one 64-wide head.
# (The families that cache the latent keep kv_lora_rank and qk_rope_head_dim at 64.)
_EXPANDED_MLA = {"qk_nope_head_dim": 32, "qk_rope_head_dim": 32}

# Phi-3-small's block-sparse layers (every other one), with blocks that bite at ~300 tokens.
_BLOCKSPARSE = {
    "dense_attention_every_n_layers": 2,
    "blocksparse_block_size": 32,
    "blocksparse_num_local_blocks": 2,
    "blocksparse_vert_stride": 2,
}

#: Per-family values where a field has no usable default, each with why.
_OVERRIDES: dict[str, dict[str, Any]] = {
    # which layers slide: none by default
    "baichuan_m1": {"sliding_window_layers": [0, 2]},
    # the real config.json names the family bailing_hybrid and picks this module by architecture
    "bailing_moe_v3": {"model_type": "bailing_hybrid", "architectures": ["BailingMoeV3ForCausalLM"]},
    # nested dicts without a dataclass to generate them from
    "dbrx": {
        "attn_config": {"kv_n_heads": 1, "clip_qkv": 8.0, "rope_theta": 10000.0},
        "ffn_config": {"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2},
    },
    # compressed KV: layer 1 compresses 4:1 and indexes, layer 2 reads layer 1's, layer 3 16:1
    "deepseek_v41": {
        "compress_ratios": [0, 4, 4, 16],
        "kv_source_layer_ids": [1, 3],
        "index_source_layer_ids": [1, 3],
    },
    # local (L, sliding, RoPE) and global (G, full, NoPE) layers are spelled as a string
    # "LG": local then global; a real config also lists layer_types (transformers' config
    # class, which the tokenizer's loader reads, cannot do without them)
    "exaone4": {
        "sliding_window_pattern": "LG",
        "layer_types": ["sliding_attention", "full_attention"] * 2,
    },
    # which layers are MoE: no default
    "exaone_moe": {"is_moe_layer": [False, True, True, True]},
    # short-convolution layers besides sliding and full attention
    "gear": {"layer_types": ["conv_mixer", _SLIDING, "conv_mixer", _FULL]},
    # transformers' config checks hidden_size * expand (2) == num_heads * head_dim
    "mamba2": {"num_heads": 4},
    "gemma3n": {
        "text_config": {
            "layer_types": [_SLIDING, _FULL] * 2,  # required; KV shared by the last two
            "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0],  # required, one a layer
        }
    },
    # the MoE variant (Gemma 4 26B-A4B: MoE blocks, keys reused as values); gemma4 keeps dense
    "gemma4_text": {"enable_moe_block": True, "attention_k_eq_v": True},
    # cross-layer KV sharing (every other layer reuses the previous layer's keys and values);
    # its RoPE reads an NTK alpha from rope_scaling, which has no default
    "hunyuan": {"use_cla": True, "rope_scaling": {"alpha": 1.0, "factor": 1.0, "type": "dynamic"}},
    # Mamba layers with an attention layer and a MoE layer in every two
    "jamba": {
        "attn_layer_offset": 1,
        "attn_layer_period": 2,
        "expert_layer_offset": 1,
        "expert_layer_period": 2,
    },
    # the Kimi delta attention layers' config: no default
    "kimi_k3": {"text_config": {"linear_attn_config": HYBRID_CONFIGS["kimi_linear"]["linear_attn_config"]}},
    # per-layer head counts
    "laguna": {"num_attention_heads_per_layer": [2, 4, 2, 4]},
    # chunked attention in 3 of 4 layers (64-token chunks), dense and MoE layers alternating
    # (its MoE routes each token to one expert: mlx-lm supports no other)
    "llama4": {
        "text_config": {"attention_chunk_size": 64, "interleave_moe_layer_step": 2, "num_experts_per_tok": 1}
    },
    "llama4_text": {"no_rope_layers": [1, 1, 1, 0]},  # 0: a NoPE layer; no default
    # zero-computation ("identity") experts next to the routed ones; the method field is unused
    "longcat_flash": {"attention_method": "MLA", "zero_expert_type": "identity", "zero_expert_num": 2},
    # n-gram embedding tables are 78 x the vocabulary by default: 2 GB here
    "longcat_flash_ngram": {"zero_expert_num": 2, "ngram_vocab_size_ratio": 1},
    "mellum": {"rope_parameters": _ROPE_BY_LAYER_TYPE},  # keyed by layer type, no default
    # sliding layers with attention sinks, the first layer dense
    "mimo_v2_flash": {"hybrid_layer_pattern": [1, 0, 1, 0], "moe_layer_freq": [0, 1, 1, 1]},
    "minimax_m3_vl": {  # block-sparse attention (an indexer picks 4 of 16-token blocks) every other layer
        "text_config": {"index_block_size": 16, "index_topk_blocks": 4, "sparse_attention_freq": [0, 1, 0, 1]}
    },
    # MLA caching expanded keys (see _EXPANDED_MLA); its RoPE reads rope_scaling (default None)
    "minicpm3": {"rope_scaling": {"original_max_position_embeddings": 4096}, **_EXPANDED_MLA},
    "ministral3": {"rope_parameters": _LLAMA4_ROPE},
    "mistral3": {"text_config": {"model_type": "mistral"}},  # Mistral Small 3.1's text model
    "mistral4": {"rope_parameters": _LLAMA4_ROPE},
    # a NoPE layer (theta 0) among RoPE layers: no default; no shared expert (not supported)
    "muse_spark": {"text_config": {"layer_rope_theta": [10000.0] * 3 + [0.0], "num_shared_experts": 0}},
    # the layer stack runs twice with shared weights, one cache a pass: the default 1 hides it
    "nanbeige": {"num_loops": 2},
    # per-layer blocks: attention with GQA groups of 2, none, a linear stand-in, GQA groups of 1
    "nemotron-nas": {
        "block_configs": [
            {"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 2.0}},
            {"attention": {"no_op": True}, "ffn": {"ffn_mult": 2.0}},
            {"attention": {"replace_with_linear": True}, "ffn": {"no_op": True}},
            {"attention": {"n_heads_in_group": 1}, "ffn": {"ffn_mult": 1.0}},
        ]
    },
    # per-layer head counts (query and KV) and FFN widths
    "openelm": {
        "num_query_heads": [2, 2, 4, 4],
        "num_kv_heads": [1, 1, 2, 2],
        "ffn_multipliers": [0.5, 1.0, 1.5, 2.0],
        "ffn_dim_divisor": 64,
    },
    "phi": {"partial_rotary_factor": 0.5},  # 0.4 of a 64-wide head is 25.6 dims: RoPE needs even
    # its Model sets the logits of ids 100256-100351 to -inf: a smaller vocabulary writes out of bounds
    "phi3small": {"vocab_size": 100352, **_BLOCKSPARSE},
    "plamo": {"n_shared_head": 2},  # KV heads = heads / n_shared_head: the default 8 needs 8 heads
    # the Hadamard-rotated 2-bit pack's checks, with one packed linear
    "prism_hadamard_qwen35": {
        "tensor_namespace": "mlx-vlm-qwen3_5",
        "quantization": {"bits": 2, "group_size": 128, "mode": "affine"},
        "modules": [
            {"path": "model.layers.3.self_attn.o_proj", "embedding": False, "dtype": "float16", "block": 0}
        ],
    },
    "recurrent_gemma": {"block_types": ["recurrent", "recurrent", "attention"]},  # no default
    "spark2_5": {"rope_parameters": _ROPE_BY_LAYER_TYPE},  # keyed by layer type, no default
    # sliding layers with their own head counts
    "step3p5": {"attention_other_setting": {"num_attention_heads": 4, "num_attention_groups": 2}},
    "youtu_llm": _EXPANDED_MLA,  # MLA caching expanded keys
}

#: Families that build but run ``mx.fast.metal_kernel`` kernels with no CPU or CUDA path.
_METAL_ONLY = {
    "bitnet": "builds, but its BitLinear layers run a Metal kernel (no Metal here)",
    "muse_spark": "builds, but it runs mlx_lm.kernels' Metal kernels (no Metal here)",
}


def _module(family: str) -> ModuleType:
    return importlib.import_module(f"mlx_lm.models.{family}")


@functools.cache
def _scan() -> tuple[tuple[str, ...], dict[str, str]]:
    """The model modules of the installed mlx-lm, and those that fail to import (with why)."""
    import mlx_lm.models as package

    families, failed = [], {}
    for info in pkgutil.iter_modules(package.__path__):
        said = io.StringIO()  # olmo prints why it is about to sys.exit(1): ai2-olmo is missing
        try:
            with contextlib.redirect_stdout(said):
                module = _module(info.name)
        except (Exception, SystemExit) as e:
            families.append(info.name)
            detail = f" ({said.getvalue().strip()})" if said.getvalue().strip() else ""
            failed[info.name] = f"importing mlx_lm.models.{info.name} fails: {_why(e)}{detail}"
            continue
        if hasattr(module, "Model") and hasattr(module, "ModelArgs"):
            families.append(info.name)
    return tuple(sorted(families)), failed


def _why(e: BaseException) -> str:
    if isinstance(e, SystemExit):
        return f"it calls sys.exit({e.code})"
    message = str(e).strip().splitlines()
    return f"{type(e).__name__}: {message[0]}" if message else type(e).__name__


def text_families() -> list[str]:
    """The families of the installed ``mlx_lm.models``: each module that defines ``Model`` and
    ``ModelArgs``, and each that fails to import (``unbuildable()`` says why)."""
    return list(_scan()[0])


def _text_args(module: ModuleType, text_type: str | None) -> type | None:
    """The dataclass a multimodal wrapper builds its language model's arguments with (found in
    the source of the wrapper or of the classes it derives from; where there are several, the
    one of ``text_type``'s module), or None for a text model."""
    if "text_config" not in {f.name for f in dataclasses.fields(module.ModelArgs)}:
        return None
    from mlx_lm.utils import MODEL_REMAPPING

    wanted = MODEL_REMAPPING.get(text_type, text_type) if text_type else None
    found: list[Any] = []
    owners = [sys.modules[c.__module__] for k in (module.ModelArgs, module.Model) for c in k.__mro__]
    for owner in dict.fromkeys(o for o in owners if o.__name__.startswith("mlx_lm.models.")):
        for name in re.findall(r"([\w.]+)\.from_dict\(\s*[\w.]*text_config", inspect.getsource(owner)):
            obj: Any = owner
            for part in name.split("."):
                obj = getattr(obj, part, None)
            if dataclasses.is_dataclass(obj):
                found.append(obj)
    return next((c for c in found if c.__module__.rsplit(".", 1)[-1] == wanted), found[0] if found else None)


def _generate(args: type, model_type: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """Generic small values for the fields of ``args``, then ``overrides``. A family whose
    source names sliding-attention layers gets them, alternating with full ones."""
    config: dict[str, Any] = {}
    for f in dataclasses.fields(args):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if f.name in _SIZES:
            config[f.name] = _SIZES[f.name]
        elif required and f.name in _FILL:
            config[f.name] = _FILL[f.name]
    config = {**config, "model_type": model_type, **overrides}
    names = {f.name for f in dataclasses.fields(args)}
    if "layer_types" in names and f'"{_SLIDING}"' in inspect.getsource(sys.modules[args.__module__]):
        layers = config.get("num_hidden_layers", _LAYERS)
        config.setdefault("layer_types", [_SLIDING, _FULL] * (layers // 2))
    return config


def family_config(family: str) -> dict[str, Any]:
    """A small config (what a ``config.json`` holds) for ``family``, a module of
    ``mlx_lm.models``; a multimodal wrapper's language model is under ``text_config``, its
    vocabulary covering the tokenizer."""
    hand = _HAND.get(family)
    if hand is not None:
        config = {"vocab_size": _VOCAB, **hand}
        if "text_config" in config:
            config["text_config"] = {"vocab_size": _VOCAB, **config["text_config"]}
        return copy.deepcopy(config)
    module = _module(family)
    overrides = dict(_OVERRIDES.get(family, {}))
    text_overrides = overrides.pop("text_config", {})
    config = _generate(module.ModelArgs, family, overrides)
    text = _text_args(module, text_overrides.get("model_type"))
    if text is not None:
        text_module = text.__module__.rsplit(".", 1)[-1]
        text_type = text_overrides.get("model_type", text_module)
        if text.__name__ == "ModelArgs" and text_type in _HAND:  # another family's language model
            text_config = {**_HAND[text_type], **text_overrides}
        else:
            default = next((f.default for f in dataclasses.fields(text) if f.name == "model_type"), None)
            if text_module == family:
                text_type = default if isinstance(default, str) and default else f"{family}_text"
            text_config = _generate(text, text_type, text_overrides)
        config["text_config"] = {"vocab_size": _VOCAB, **text_config}
    return copy.deepcopy(config)  # ModelArgs.__post_init__ of some families edit it in place


def unbuildable() -> dict[str, str]:
    """Family -> why no model is built and run from its config here, found by trying: importing
    the module, generating the config, ``ModelArgs.from_dict`` and the model's constructor (lazy:
    no weights are computed, so trying every family takes a moment); plus, without Metal, the
    families whose kernels only Metal runs."""
    return dict(_unbuildable())


@functools.cache
def _unbuildable() -> tuple[tuple[str, str], ...]:
    from mlx_lm.utils import _get_classes

    reasons = dict(_scan()[1])
    for family in text_families():
        if family in reasons:
            continue
        try:
            config = family_config(family)
            model_class, args_class = _get_classes(config)
            model_class(args_class.from_dict(config))
        except Exception as e:
            reasons[family] = f"building it from a generated config fails: {_why(e)}"
            continue
        refused = _transformers_refuses(config)
        if refused:
            reasons[family] = f"mlx_lm.load fails on its config here: transformers refuses it ({refused})"
    if not mx.metal.is_available():
        reasons.update(_METAL_ONLY)
    return tuple(reasons.items())


def _transformers_refuses(config: dict[str, Any]) -> str:
    """Why transformers' config loading, which ``mlx_lm.load`` runs to load the tokenizer
    (``AutoTokenizer`` reads ``config.json``), fails on ``config`` ("" where it does not):
    plain mlx-lm cannot load such a directory either."""
    import json
    import tempfile

    from transformers import AutoConfig, PreTrainedConfig

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        try:
            try:  # the same fallback as AutoTokenizer.from_pretrained
                AutoConfig.from_pretrained(tmp)
            except (ValueError, OSError):
                PreTrainedConfig.from_pretrained(tmp)
        except Exception as e:
            return _why(e)
    return ""
