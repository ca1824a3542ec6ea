"""ModelCacheSpec describes per-layer KV shapes; MLA (K != V) included (random weights)."""

from __future__ import annotations

from langchain_agent_memory.engine.kv.spec import LayerSpec
from langchain_agent_memory.engine.model.structure import describe


def test_deepseek_v2_mla_has_different_k_and_v_dims() -> None:
    from mlx_lm.models import deepseek_v2

    args = deepseek_v2.ModelArgs(
        model_type="deepseek_v2",
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        kv_lora_rank=32,
        q_lora_rank=None,
        qk_rope_head_dim=16,
        v_head_dim=24,
        qk_nope_head_dim=32,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        rope_scaling={"factor": 1.0},
    )
    spec = describe(deepseek_v2.Model(args)).spec
    # MLA decompresses the latent into per-head K (nope + rope dims) and V (v_head_dim).
    assert spec.layers == (LayerSpec(kv_heads=4, k_head_dim=48, v_head_dim=24, window=None),) * 3
    assert spec.fp16_bytes_per_token() == 3 * 2 * 4 * (48 + 24)


def test_gemma3_layout_from_a_small_config() -> None:
    from mlx_lm.models import gemma3_text

    args = gemma3_text.ModelArgs(
        model_type="gemma3_text",
        hidden_size=64,
        num_hidden_layers=7,
        intermediate_size=128,
        num_attention_heads=4,
        head_dim=32,
        num_key_value_heads=1,
        vocab_size=100,
        sliding_window=16,
        sliding_window_pattern=6,
    )
    spec = describe(gemma3_text.Model(args)).spec
    windows = [layer.window for layer in spec.layers]
    assert windows == [16, 16, 16, 16, 16, None, 16]
    assert {(s.kv_heads, s.k_head_dim, s.v_head_dim) for s in spec.layers} == {(1, 32, 32)}
    assert spec.digest() == describe(gemma3_text.Model(args)).spec.digest()
