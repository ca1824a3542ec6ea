"""mlx-lm model directories with random weights, built from a config: architecture
coverage in tests and timing at scale in benchmarks, for families whose real weights
cannot ship here. Numbers measured on them say "random weights" next to them; quality
numbers come from real weights only.

The tokenizer files are copied from a real model directory (SmolLM2's by default), so
text goes in and out as with any model; ``vocab_size`` must cover that tokenizer.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from ..engine.ops.runtime import mx
from .hybrid_configs import HYBRID_CONFIGS

#: Tokenizer files copied into a random model's directory.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

_SMALL_VOCAB = 49152  # SmolLM2's tokenizer

#: Small configs, one per supported family: a few layers, the family's distinguishing
#: features kept (GQA, biases, q/k norms, fused qkv, sliding windows, sinks, MoE, MLA).
#: Heads are 64 wide; ``WIDTH_CONFIGS`` has the other widths.
SMALL_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {
        "model_type": "llama",
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "intermediate_size": 256,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "tie_word_embeddings": False,
        "max_position_embeddings": 131072,
    },
    "mistral": {
        "model_type": "mistral",
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "max_position_embeddings": 32768,
    },
    "qwen2": {
        "model_type": "qwen2",
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "intermediate_size": 256,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "max_position_embeddings": 32768,
    },
    "qwen3": {
        "model_type": "qwen3",
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "max_position_embeddings": 40960,
    },
    "gemma3_text": {
        "model_type": "gemma3_text",
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "intermediate_size": 256,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "query_pre_attn_scalar": 64,
        "sliding_window": 48,
        "sliding_window_pattern": 2,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
    },
    "phi3": {
        "model_type": "phi3",
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "intermediate_size": 256,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "original_max_position_embeddings": 4096,
    },
    "gpt_oss": {
        "model_type": "gpt_oss",
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "intermediate_size": 64,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "sliding_window": 48,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_theta": 150000,
        "max_position_embeddings": 131072,
    },
    "deepseek_v2": {
        "model_type": "deepseek_v2",
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "kv_lora_rank": 64,
        "q_lora_rank": None,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 64,
        "v_head_dim": 64,
        "first_k_dense_replace": 1,
        "max_position_embeddings": 4096,
        "rope_scaling": {"factor": 1.0},
    },
}
# The same MLA shapes, with V3's own attention: a compressed query, the latent stored as is.
SMALL_CONFIGS["deepseek_v3"] = {
    **SMALL_CONFIGS["deepseek_v2"],
    "model_type": "deepseek_v3",
    "q_lora_rank": 64,
    "rope_scaling": None,
}

#: The head widths of real models other than 64, each on a family that has it, for the
#: default KV format (``TensorCodec.for_width``): 72 (no rotation block), 80 (no group
#: tiles it: padded), 96 (Phi-3-mini: hidden 3072 over 32 heads), 128, 192 / 128 (MLA keys /
#: values), 256 (Gemma 3).
WIDTH_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-hd72": {
        **SMALL_CONFIGS["llama"],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 72,
    },
    "llama-hd80": {
        **SMALL_CONFIGS["llama"],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 80,
    },
    "phi3-hd96": {**SMALL_CONFIGS["phi3"], "hidden_size": 192},
    "qwen3-hd128": {**SMALL_CONFIGS["qwen3"], "head_dim": 128},
    "gemma3_text-hd256": {**SMALL_CONFIGS["gemma3_text"], "head_dim": 256, "query_pre_attn_scalar": 256},
    "deepseek_v2-mla192": {**SMALL_CONFIGS["deepseek_v2"], "qk_nope_head_dim": 128, "v_head_dim": 128},
}

#: Published shapes of the models users run at scale (from their ``config.json``), for GPU
#: timing with random weights (``benchmarks/gpu.py``). Vocabularies are the real ones.
SCALE_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {
        **SMALL_CONFIGS["llama"],
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
    },
    "qwen3-8b": {
        **SMALL_CONFIGS["qwen3"],
        "hidden_size": 4096,
        "num_hidden_layers": 36,
        "intermediate_size": 12288,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": False,
        "vocab_size": 151936,
    },
    "gemma-3-4b": {
        **SMALL_CONFIGS["gemma3_text"],
        "hidden_size": 2560,
        "num_hidden_layers": 34,
        "intermediate_size": 10240,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "max_position_embeddings": 131072,
        "vocab_size": 262144,
    },
    # Qwen3-Next-80B-A3B's published shape with 64 of its 512 experts (10 active per token
    # either way: the same work per token): 23 GB of bf16, where all 512 are 160 GB (more than
    # an H200's memory) and 128 would leave the lent machine's 64 GB disk no room for caches.
    "qwen3-next-80b-a3b-e64": {
        **HYBRID_CONFIGS["qwen3_next"],
        "hidden_size": 2048,
        "num_hidden_layers": 48,
        "full_attention_interval": 4,
        "intermediate_size": 5120,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "num_experts": 64,
        "num_experts_per_tok": 10,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "vocab_size": 151936,
    },
    # The same layer kinds at a size this CPU prefills 8K tokens of in seconds.
    "qwen3-next-small": {
        **HYBRID_CONFIGS["qwen3_next"],
        "hidden_size": 512,
        "num_hidden_layers": 8,
        "full_attention_interval": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 8,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 256,
        "shared_expert_intermediate_size": 256,
    },
    "gpt-oss-20b": {
        **SMALL_CONFIGS["gpt_oss"],
        "hidden_size": 2880,
        "num_hidden_layers": 24,
        "intermediate_size": 2880,
        "num_local_experts": 32,
        "num_experts_per_tok": 4,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 12,
        "vocab_size": 201088,
    },
}


def write_random_model(
    config: dict[str, Any],
    out: Path,
    tokenizer_dir: Path,
    *,
    seed: int = 0,
    dtype: str = "float32",
) -> Path:
    """Build ``config``'s mlx-lm model with random weights (seeded) and write it, with the
    tokenizer of ``tokenizer_dir``, as an mlx-lm model directory at ``out``."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes  # mlx-lm's own family lookup (remaps included)

    config = {"vocab_size": _SMALL_VOCAB, **config}
    if "text_config" in config:  # a multimodal wrapper's language model (Qwen 3.5)
        config["text_config"] = {"vocab_size": config["vocab_size"], **config["text_config"]}
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(getattr(mx, dtype))
    weights = dict(tree_flatten(model.parameters()))
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps({**config, "torch_dtype": dtype}, indent=2))
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    return out
