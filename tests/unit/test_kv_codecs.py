"""KV codecs: rotation is orthonormal and deterministic, every preset round-trips within
its error, and attention over rotated/quantized committed keys matches full precision
(no model: random K/V with an outlier channel, as real keys have)."""

from __future__ import annotations

import numpy as np
import pytest

from langchain_agent_memory.engine.cache import KV_PRESETS, KVQuant, LayerCache, TensorCodec, rotation
from langchain_agent_memory.engine.runtime import mx
from langchain_agent_memory.engine.spec import LayerSpec


@pytest.mark.parametrize("dim", [64, 128, 192, 256])
def test_rotation_is_orthonormal_and_fixed(dim: int) -> None:
    r = np.array(rotation(dim))
    np.testing.assert_allclose(r @ r.T, np.eye(dim), atol=1e-5)
    rotation.cache_clear()
    np.testing.assert_array_equal(np.array(rotation(dim)), r)  # same in every process


def _kv(n: int = 300, d: int = 64, heads: int = 2) -> tuple[mx.array, mx.array]:
    mx.random.seed(0)
    k = mx.random.normal((1, heads, n, d))
    k = k + mx.zeros((d,)).at[3].add(20.0)  # an outlier channel, as in real keys
    return k, mx.random.normal((1, heads, n, d))


def _rel(a: mx.array, b: mx.array) -> float:
    return (mx.linalg.norm(a - b) / mx.linalg.norm(b)).item()


def test_rotation_reduces_the_error_of_outlier_keys() -> None:
    k, _ = _kv()
    plain, rot = KV_PRESETS["q4"].keys, KV_PRESETS["q4-rot"].keys
    err_plain = _rel(plain.decode(plain.encode(k), mx.float32), k)
    back = rot.decode(rot.encode(k), mx.float32) @ rotation(64).T
    assert _rel(back, k) < 0.7 * err_plain


def _attention_error(kv: KVQuant, n_queries: int) -> float:
    """Relative error of attention over committed keys stored as ``kv`` vs float32."""
    k, v = _kv()
    spec = LayerSpec(kv_heads=2, k_head_dim=64, v_head_dim=64, window=None)
    caches = [LayerCache(spec, fmt, mx.float32) for fmt in (KVQuant.uniform(None), kv)]
    for cache in caches:
        cache.update_and_fetch(k[:, :, :-n_queries], v[:, :, :-n_queries])
        cache.commit()  # the stored part
        cache.update_and_fetch(k[:, :, -n_queries:], v[:, :, -n_queries:])
    q = mx.random.normal((1, 6, n_queries, 64), key=mx.random.key(1)) * 3
    want, got = (c.attend(q, 0.125) for c in caches)
    return _rel(got, want)


@pytest.mark.parametrize("n_queries", [1, 40])  # decode path and prefill (dequantize) path
def test_rotation_plumbing_is_exact(n_queries: int) -> None:
    rotated = KVQuant(TensorCodec(None, rotate=True), TensorCodec(None, rotate=True))
    assert _attention_error(rotated, n_queries) < 2e-3  # float16 storage only


@pytest.mark.parametrize("n_queries", [1, 40])
def test_error_ordering_of_the_presets(n_queries: int) -> None:
    err = {name: _attention_error(kv, n_queries) for name, kv in KV_PRESETS.items()}
    assert err["fp16"] < 2e-3
    assert err["q8"] < err["k8v4-rot"] < err["q4"]
    assert err["q4-rot"] < err["q4"]  # the outlier channel no longer owns the 4-bit range
    assert err["q4g32"] < err["q4"]
