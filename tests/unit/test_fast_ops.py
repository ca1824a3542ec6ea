"""fast_ops: the polynomial exp and the BLAS attention agree with mlx's own kernels (no model)."""

from __future__ import annotations

import math

import mlx.nn as nn
import numpy as np
import pytest

from langchain_agent_memory.engine.ops import cpu_attention, fast_ops
from langchain_agent_memory.engine.ops.runtime import mx


def _rel(out: mx.array, ref: mx.array) -> float:
    a = np.array(out.astype(mx.float32), dtype=np.float64)
    b = np.array(ref.astype(mx.float32), dtype=np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("n", [1000, 200_001])  # shapeless kernels / per-shape kernels
def test_fast_exp_relative_error(n: int) -> None:
    xs = np.concatenate(
        [np.linspace(-80, 80, n, dtype=np.float32), np.random.default_rng(0).uniform(-80, 80, n)]
    ).astype(np.float32)
    got = np.array(fast_ops.fast_exp(mx.array(xs)), dtype=np.float64)
    ref = np.exp(xs.astype(np.float64))
    assert float(np.max(np.abs(got - ref) / ref)) <= 2e-7


def test_fast_exp_special_values() -> None:
    x = mx.array([-math.inf, -1e30, -1000.0, -90.0, 0.0, 1.0, 100.0, math.nan])
    got = np.array(fast_ops.fast_exp(x))
    assert list(got[:4]) == [0.0, 0.0, 0.0, 0.0]
    assert got[4] == 1.0
    assert got[5] == pytest.approx(math.e, rel=2e-7)
    assert np.isfinite(got[6]) and got[6] > 1e38  # saturates instead of inf
    assert np.isnan(got[7])


@pytest.mark.parametrize("shape", [(3, 7), (2, 5, 4096)])
def test_fast_softmax_matches_mx(shape: tuple[int, ...]) -> None:
    x = mx.random.normal(shape, key=mx.random.key(1)) * 5
    assert _rel(fast_ops.fast_softmax(x), mx.softmax(x, axis=-1)) < 1e-6
    assert _rel(fast_ops.fast_softmax(x, axis=0), mx.softmax(x, axis=0)) < 1e-6


def test_fast_softmax_masks_minus_inf() -> None:
    x = mx.array([[0.0, -math.inf, 1.0], [-math.inf, 2.0, -math.inf]])
    got = np.array(fast_ops.fast_softmax(x))
    assert got[0, 1] == 0.0 and got[1, 0] == 0.0 and got[1, 2] == 0.0
    assert got[1, 1] == pytest.approx(1.0)
    assert got[0, 2] == pytest.approx(1 / (1 + math.exp(-1)), rel=1e-6)


def test_activations_match_float64() -> None:
    g = mx.random.normal((1, 1, 100_000), key=mx.random.key(2)) * 4
    x = mx.random.normal((1, 1, 100_000), key=mx.random.key(3))
    gd = np.array(g, dtype=np.float64)
    xd = np.array(x, dtype=np.float64)
    silu = gd / (1 + np.exp(-gd))
    gelu = 0.5 * gd * (1 + np.tanh(math.sqrt(2 / math.pi) * (gd + 0.044715 * gd**3)))

    def close(out: mx.array, ref: np.ndarray) -> None:
        got = np.array(out, dtype=np.float64)
        assert float(np.max(np.abs(got - ref) / np.maximum(np.abs(ref), 1e-3))) < 2e-6

    close(fast_ops.fast_silu(g), silu)
    close(fast_ops.fast_swiglu(g, x), silu * xd)
    close(fast_ops.gelu_approx(g), gelu)
    close(fast_ops.gelu_approx_mul(g, x), gelu * xd)


def test_small_activations_are_mlx_own() -> None:
    # One decoded token: the single compiled mlx op is cheaper than building ours.
    g = mx.random.normal((1, 1, 1536), key=mx.random.key(4)) * 4
    x = mx.random.normal((1, 1, 1536), key=mx.random.key(5))
    assert _rel(fast_ops.fast_silu(g), nn.silu(g)) < 1e-6
    assert _rel(fast_ops.fast_swiglu(g, x), nn.silu(g) * x) < 1e-6
    assert _rel(fast_ops.gelu_approx(g), nn.gelu_approx(g)) < 1e-6
    assert _rel(fast_ops.gelu_approx_mul(g, x), nn.gelu_approx(g) * x) < 1e-6


def _qkv(h: int, kv: int, L: int, kL: int, d: int, seed: int = 0) -> tuple[mx.array, mx.array, mx.array]:
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    return (
        mx.random.normal((1, h, L, d), key=k1),
        mx.random.normal((1, kv, kL, d), key=k2),
        mx.random.normal((1, kv, kL, d), key=k3),
    )


def _masks(h: int, L: int, kL: int) -> dict[str, object]:
    rng = np.random.default_rng(L * 1000 + kL)
    keep = rng.random((L, kL)) < 0.7
    keep[:, -1] = True  # no fully masked row (additive -inf would give NaN, as in mx.fast)
    causal = np.arange(kL - L, kL)[:, None] >= np.arange(kL)[None]
    window = causal & (np.arange(kL - L, kL)[:, None] < np.arange(kL)[None] + 16)
    per_head = rng.random((1, h, L, kL)) < 0.6
    per_head[..., -1] = True
    return {
        "none": None,
        "causal": "causal",
        "bool": mx.array(keep),
        "bool-window": mx.array(window),
        "bool-4d": mx.array(keep[None, None]),
        "bool-per-head": mx.array(per_head),
        "additive": mx.array(np.where(keep, rng.normal(size=(L, kL)), -np.inf).astype(np.float32)),
        "additive-3d": mx.array(np.where(per_head[0], 0.0, -1e9).astype(np.float32)),
    }


@pytest.mark.parametrize(
    ("h", "kv", "L", "kL", "d"),
    [
        (4, 2, 1, 37, 16),  # decode, tiny: mx.fast path
        (9, 3, 1, 2000, 64),  # decode: SmolLM2-like GQA
        (4, 1, 1, 4500, 32),  # decode: Gemma-like (one KV head)
        (4, 4, 7, 20, 8),  # no GQA, cache offset
        (9, 3, 40, 120, 64),  # a short turn after a cached prefix (softmax in NumPy)
        (4, 1, 64, 64, 32),
        (2, 1, 300, 340, 16),  # long enough for the causal query blocks
        (9, 3, 128, 2300, 64),  # a prefill chunk over a long cache
        (4, 1, 300, 2600, 16),  # a long prefill: query blocks
        (9, 3, 1, 2100, 64),  # decode over a long cache: one pass, no tiles
        (3, 1, 15, 8300, 16),  # a warm agent's new turn over a long cache: softmax in NumPy
    ],
)
def test_attention_matches_mx_fast(h: int, kv: int, L: int, kL: int, d: int) -> None:
    q, k, v = _qkv(h, kv, L, kL, d)
    scale = d**-0.5
    for name, mask in _masks(h, L, kL).items():
        ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
        out = cpu_attention.attention(q, k, v, scale, mask)
        assert out.shape == ref.shape and out.dtype == ref.dtype
        assert _rel(out, ref) < 1e-5, name


@pytest.mark.parametrize(("h", "kv", "L", "kL"), [(9, 3, 128, 2300), (4, 1, 300, 2600), (3, 1, 15, 1100)])
def test_attention_in_key_tiles_matches_mx_fast(
    h: int, kv: int, L: int, kL: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Where a block's scores would be too large (a large model's long prefill), keys go in tiles.
    monkeypatch.setattr(cpu_attention, "_HOST_MAX_SCORES", 0)
    q, k, v = _qkv(h, kv, L, kL, 32)
    for name, mask in _masks(h, L, kL).items():
        ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask=mask)
        assert _rel(cpu_attention.attention(q, k, v, 0.2, mask), ref) < 1e-5, name


@pytest.mark.parametrize(("h", "kv", "L", "kL"), [(9, 3, 40, 600), (4, 1, 300, 1100), (3, 1, 15, 1000)])
def test_attention_host_key_tiles_match_mx_fast(
    h: int, kv: int, L: int, kL: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A block of queries over many keys takes them in tiles, the softmax merged across tiles:
    # every mask kind, and a row that one tile masks whole (or every tile: uniform, as mx.fast).
    monkeypatch.setattr(cpu_attention, "_HOST_UNTILED_SCORES", 0)
    monkeypatch.setattr(cpu_attention, "_HOST_TILE_SCORES", 1)  # tiles of 256 keys
    q, k, v = _qkv(h, kv, L, kL, 32)
    masks = _masks(h, L, kL)
    keep = np.arange(kL - L, kL)[:, None] >= np.arange(kL)[None]
    keep[2, :300] = False  # masked whole in the first tile only
    keep[5] = False  # masked everywhere
    masks["holes"] = mx.array(keep)
    for name, mask in masks.items():
        ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask=mask)
        assert _rel(cpu_attention.attention(q, k, v, 0.2, mask), ref) < 1e-5, name


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_attention_additive_mask_in_16_bits(dtype: mx.Dtype) -> None:
    q, k, v = _qkv(4, 2, 40, 300, 16)
    keep = np.arange(260, 300)[:, None] >= np.arange(300)[None]
    mask = mx.array(np.where(keep, 0.0, -1e4).astype(np.float32)).astype(dtype)
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mx.array(keep))
    assert _rel(cpu_attention.attention(q, k, v, 0.25, mask), ref) < 1e-5


def test_attention_one_dimensional_mask() -> None:
    # RotatingKVCache.make_mask gives a (kL,) boolean mask for one query past the window.
    q, k, v = _qkv(4, 1, 1, 5000, 32)
    mask = mx.arange(5000) >= 1000
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask=mask)
    assert _rel(cpu_attention.attention(q, k, v, 0.2, mask), ref) < 1e-5


@pytest.mark.parametrize(("L", "kL"), [(40, 90), (300, 300)])  # short; long (query blocks)
def test_attention_fully_masked_row_is_uniform_like_mx_fast(L: int, kL: int) -> None:
    q, k, v = _qkv(4, 2, L, kL, 16)
    keep = np.arange(kL - L, kL)[:, None] >= np.arange(kL)[None]
    keep[3] = False
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mx.array(keep))
    assert _rel(cpu_attention.attention(q, k, v, 0.25, mx.array(keep)), ref) < 1e-5


def test_attention_float16() -> None:
    q, k, v = (a.astype(mx.float16) for a in _qkv(9, 3, 50, 80, 64))
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
    out = cpu_attention.attention(q, k, v, 0.125, "causal")
    assert out.dtype == mx.float16
    assert _rel(out, ref) < 2e-3  # both round the output to float16


def test_kernels_are_called_without_touching_mlx_lm() -> None:
    """An adapted model instance runs our attention / MLP; another instance of the same
    classes, mlx-lm's modules and its classes stay exactly as they were."""
    from mlx_lm.models import base, gemma3_text, llama

    from langchain_agent_memory.engine.model.adapters import adapt_model, is_adapted

    before = (llama.scaled_dot_product_attention, llama.swiglu, gemma3_text.MLP.__dict__["__call__"])
    args = llama.ModelArgs(
        model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=300,
    )  # fmt: skip
    mx.random.seed(3)
    ours, theirs = llama.Model(args), llama.Model(args)
    theirs.update(ours.parameters())
    # 2 attention + 2 MLP + 5 RMSNorm + 2 RoPE modules, once
    assert adapt_model(ours) == 11 and adapt_model(ours) == 0
    assert is_adapted(ours) and not is_adapted(theirs)
    assert type(theirs.layers[0].self_attn) is llama.Attention
    assert isinstance(ours.layers[0].self_attn, llama.Attention)  # a subclass of its own
    assert (llama.scaled_dot_product_attention, llama.swiglu, gemma3_text.MLP.__dict__["__call__"]) == before
    assert llama.scaled_dot_product_attention is base.scaled_dot_product_attention
    tokens = mx.array([list(range(40, 240))])  # 200 positions: past the small-problem fallbacks
    assert _rel(ours(tokens), theirs(tokens)) < 1e-4


def _ropes_and_norms() -> list[nn.Module]:
    from mlx_lm.models import gemma3_text, rope_utils

    llama3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    llama3["original_max_position_embeddings"] = 8192
    return [
        nn.RoPE(64, traditional=False, base=10000.0),
        nn.RoPE(64, traditional=False, base=10000.0),  # same configuration: shares tables
        nn.RoPE(64, traditional=True, base=500000.0),
        nn.RoPE(32, traditional=False, base=10000.0),  # partial rotary dims (head dim 64)
        rope_utils.Llama3RoPE(64, 131072, False, 500000.0, llama3),
        nn.RMSNorm(64, eps=1e-5),
        gemma3_text.RMSNorm(64, eps=1e-6),
    ]


def test_adapted_norms_and_ropes_give_mlx_bits() -> None:
    """An adapted model's RMSNorm and RoPE modules (fewer ops per decode step) give exactly
    the bits of mlx's own ops: one token at positions 0, 37 and 8191, a turn's 15 tokens,
    in float32 and bfloat16; RoPEs of one configuration share one table per step."""
    from langchain_agent_memory.engine.model.adapters import adapt_model

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mods = _ropes_and_norms()

    ours, theirs = Holder(), Holder()
    for a, b in zip(ours.mods, theirs.mods, strict=True):
        if "weight" in a:
            a.weight = b.weight = mx.random.normal(a.weight.shape, key=mx.random.key(5))
    assert adapt_model(ours) == len(ours.mods)
    for dtype in (mx.float32, mx.bfloat16):
        for L, offset in ((1, 0), (1, 37), (1, 8191), (15, 300)):
            x = mx.random.normal((1, 4, L, 64), key=mx.random.key(L + offset)).astype(dtype)
            for a, b in zip(ours.mods, theirs.mods, strict=True):
                got, ref = (a(x), b(x)) if "weight" in a else (a(x, offset=offset), b(x, offset=offset))
                where = (type(b).__name__, L, offset)
                assert got.dtype == ref.dtype and mx.array_equal(got, ref).item(), where
    tables = [m.__dict__.get("_agent_memory_rope") for m in ours.mods[:5]]
    assert tables[0] is tables[1] and len({id(t) for t in tables}) == 4


def test_a_rope_of_another_form_keeps_its_own_code() -> None:
    """A RoPE-named module whose output is not a rotation by position tables (here it also
    shifts by the offset) is checked when the model is adapted, and left as it is."""
    from langchain_agent_memory.engine.model.adapters import adapt_model

    class OddRoPE(nn.RoPE):
        def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
            rotated = mx.fast.rope(x, self.dims, traditional=False, base=10000.0, scale=1.0, offset=offset)
            return rotated + offset

    OddRoPE.__module__ = "mlx_lm.models.odd"  # as if mlx-lm shipped it

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rope = OddRoPE(64)

    model = Holder()
    assert adapt_model(model) == 0 and type(model.rope) is OddRoPE
    x = mx.random.normal((1, 2, 1, 64), key=mx.random.key(1))
    assert mx.array_equal(model.rope(x, offset=5), OddRoPE(64)(x, offset=5)).item()


@pytest.mark.parametrize("tied", [True, False])
def test_vocabulary_projection_split_across_streams_gives_the_same_logits(
    monkeypatch: pytest.MonkeyPatch, tied: bool
) -> None:
    """A decode step's vocabulary projection runs as two halves on two CPU streams (both
    cores) where the weight is large: the same bits as the model's own projection."""
    from mlx_lm.models import llama

    from langchain_agent_memory.engine.model import adapters

    args = llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=1, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=5001,
        tie_word_embeddings=tied,
    )  # fmt: skip
    model = llama.Model(args)
    mx.eval(model.parameters())
    hidden = mx.random.normal((1, 1, 64), key=mx.random.key(9))
    theirs = model.model.embed_tokens.as_linear(hidden) if tied else model.lm_head(hidden)
    calls = []
    split = adapters._split_projection
    monkeypatch.setattr(adapters, "_SPLIT_BYTES", 0)
    monkeypatch.setattr(adapters, "_split_projection", lambda *a: calls.append(1) or split(*a))
    adapters.adapt_model(model)
    ours = model.model.embed_tokens.as_linear(hidden) if tied else model.lm_head(hidden)
    assert calls and ours.shape == theirs.shape == (1, 1, 5001)
    assert mx.array_equal(ours, theirs).item()


def test_a_load_that_adapts_nothing_says_so(caplog: pytest.LogCaptureFixture) -> None:
    """A model whose classes the adapters do not know (here: one adapted already, as if
    mlx-lm had renamed its classes) runs mlx-lm's own code, and the load says so once."""
    from mlx_lm.models import llama

    from langchain_agent_memory.engine.model.loading import adapt_or_say

    args = llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=1, intermediate_size=128,
        num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5, vocab_size=100,
    )  # fmt: skip
    model = llama.Model(args)
    with caplog.at_level("WARNING"):
        assert adapt_or_say(model, "tiny") > 0
        assert not caplog.records
        assert adapt_or_say(model, "tiny") == 0
    (said,) = caplog.records
    assert "no module of this mlx_lm.models.llama model was adapted" in said.getMessage()
