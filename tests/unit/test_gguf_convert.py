"""The GGUF converter's name mapping, Q/K un-permutation and its refusals (real GGUF files
written with the `gguf` package; no model weights needed)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter

from langchain_agent_memory.engine.model.gguf_convert import (
    SUPPORTED_ARCHITECTURES,
    UnsupportedGGUFError,
    convert_gguf,
    mlx_name,
    unpermute_qk,
)

LLAMA = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.0.attn_norm.weight": "model.layers.0.input_layernorm.weight",
    "blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
    "blk.0.attn_k.weight": "model.layers.0.self_attn.k_proj.weight",
    "blk.0.attn_v.weight": "model.layers.0.self_attn.v_proj.weight",
    "blk.12.attn_output.weight": "model.layers.12.self_attn.o_proj.weight",
    "blk.1.ffn_norm.weight": "model.layers.1.post_attention_layernorm.weight",
    "blk.1.ffn_gate.weight": "model.layers.1.mlp.gate_proj.weight",
    "blk.1.ffn_up.weight": "model.layers.1.mlp.up_proj.weight",
    "blk.29.ffn_down.weight": "model.layers.29.mlp.down_proj.weight",
}
GEMMA3 = {
    "blk.0.attn_norm.weight": "model.layers.0.input_layernorm.weight",
    "blk.0.post_attention_norm.weight": "model.layers.0.post_attention_layernorm.weight",
    "blk.0.ffn_norm.weight": "model.layers.0.pre_feedforward_layernorm.weight",
    "blk.0.post_ffw_norm.weight": "model.layers.0.post_feedforward_layernorm.weight",
    "blk.0.attn_q_norm.weight": "model.layers.0.self_attn.q_norm.weight",
    "blk.0.attn_k_norm.weight": "model.layers.0.self_attn.k_norm.weight",
    "blk.17.attn_q.weight": "model.layers.17.self_attn.q_proj.weight",
}


@pytest.mark.parametrize(("arch", "table"), [("llama", LLAMA), ("gemma3", GEMMA3)])
def test_names_map_onto_mlx_lm(arch: str, table: dict[str, str]) -> None:
    assert {g: mlx_name(arch, g) for g in table} == table


def test_names_map_onto_real_mlx_lm_parameters() -> None:
    """Every mapped llama name is a parameter of mlx-lm's own llama model."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=30,
        intermediate_size=128,
        num_attention_heads=4,
        rms_norm_eps=1e-5,
        vocab_size=100,
        tie_word_embeddings=False,
    )
    params = {k for k, _ in tree_flatten(llama.Model(args).parameters())}
    assert set(LLAMA.values()) <= params


def test_unknown_tensor_is_refused() -> None:
    with pytest.raises(UnsupportedGGUFError, match="no counterpart"):
        mlx_name("llama", "blk.0.ssm_conv1d.weight")


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp convert_hf_to_gguf.py LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("n_head", [1, 3, 9])
def test_unpermute_inverts_llama_cpp_permute(n_head: int) -> None:
    w = np.random.default_rng(0).normal(size=(n_head * 64, 40)).astype(np.float32)
    permuted = _llama_cpp_permute(w, n_head)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(unpermute_qk(permuted, n_head), w)


def _write_gguf(path: Path, arch: str, tensor_type: GGMLQuantizationType | None = None) -> None:
    w = GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(2)
    w.add_layer_norm_rms_eps(1e-5)
    data = np.zeros((64, 64), dtype=np.float32)
    if tensor_type is None:
        w.add_tensor("blk.0.attn_norm.weight", data[0])
    else:  # raw bytes of the given type, shaped as bytes per row (Q8_1: 40 bytes per 32 values)
        w.add_tensor("blk.0.attn_q.weight", np.zeros((64, 80), dtype=np.uint8), raw_dtype=tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unsupported_architecture_names_the_supported_ones(tmp_path: Path) -> None:
    src = tmp_path / "m.gguf"
    _write_gguf(src, "mamba")
    with pytest.raises(UnsupportedGGUFError, match="'mamba'.*" + ", ".join(SUPPORTED_ARCHITECTURES)):
        convert_gguf(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_unsupported_tensor_type_names_the_supported_ones(tmp_path: Path) -> None:
    src = tmp_path / "m.gguf"
    _write_gguf(src, "llama", GGMLQuantizationType.Q8_1)
    with pytest.raises(UnsupportedGGUFError, match=r"Q8_1 cannot be dequantized; supported: .*Q4_K"):
        convert_gguf(src, tmp_path / "out")


def test_not_a_gguf_file(tmp_path: Path) -> None:
    src = tmp_path / "junk.gguf"
    src.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(UnsupportedGGUFError, match="not a readable GGUF"):
        convert_gguf(src, tmp_path / "out")
