"""KV codecs: rotation is orthonormal and deterministic, every preset round-trips within
its error, and attention over rotated/quantized committed keys matches full precision
(no model: random K/V with an outlier channel, as real keys have)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from langchain_agent_memory.engine.kv import (
    KV_PRESETS,
    ROTATION_SCHEME,
    KVQuant,
    LayerCache,
    TensorCodec,
    kv_format,
    rotation,
    rotation_signs,
    unpack_affine,
)
from langchain_agent_memory.engine.kv.spec import LayerSpec
from langchain_agent_memory.engine.ops.runtime import mx


@pytest.mark.parametrize("dim", [64, 128, 192, 256])
def test_rotation_is_orthonormal_and_fixed(dim: int) -> None:
    r = np.array(rotation(dim))
    np.testing.assert_allclose(r @ r.T, np.eye(dim), atol=1e-5)
    rotation.cache_clear()
    np.testing.assert_array_equal(np.array(rotation(dim)), r)  # same in every process


def test_rotation_is_pinned_by_golden_values() -> None:
    """Stored rotated caches are only readable under the same matrix: its signs come from
    SHAKE-256 (not a NumPy RNG stream, which may change between NumPy versions), and
    these values must never change without a new ``ROTATION_SCHEME``."""
    signs = "".join("+" if x > 0 else "-" for x in rotation_signs(64))
    assert signs == "++-+--++++-++-++-+++-+-++-++--++--++---+++++-+-+-+-----+-+++--+-"
    assert ROTATION_SCHEME == "hadamard-shake256-v1"
    digest = {d: hashlib.sha256(np.array(rotation(d)).tobytes()).hexdigest()[:16] for d in (128, 192)}
    assert digest == {128: "0052b0b214306840", 192: "9131088231ff7f6b"}
    assert ROTATION_SCHEME in kv_format(4).identity and ROTATION_SCHEME not in kv_format(8).identity


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


def _attention_error(kv: KVQuant, n_queries: int, d: int = 64, serve_stored: bool = False) -> float:
    """Relative error of attention over committed keys stored as ``kv`` (fitted to ``d``-wide
    heads, as the engine fits it) vs float32."""
    k, v = _kv(d=d)
    spec = LayerSpec(kv_heads=2, k_head_dim=d, v_head_dim=d, window=None)
    caches = [
        LayerCache(spec, fmt.for_dims(d, d), mx.float32, serve_stored=serve_stored)
        for fmt in (KVQuant.uniform(None), kv)
    ]
    for cache in caches:
        cache.update_and_fetch(k[:, :, :-n_queries], v[:, :, :-n_queries])
        cache.commit()  # the stored part
        cache.update_and_fetch(k[:, :, -n_queries:], v[:, :, -n_queries:])
    q = mx.random.normal((1, 6, n_queries, d), key=mx.random.key(1)) * 3
    want, got = (c.attend(q, 0.125) for c in caches)
    return _rel(got, want)


#: How the default format stores each head width (``TensorCodec.for_width``). Stored caches
#: depend on it: a change here is a format change (new fingerprint), never an accident.
DEFAULT_BY_WIDTH = {
    64: ("6g64h", "4g64h"),
    72: ("6g32+pad", "4g32+pad"),  # no power-of-two block >= 16: not rotated
    80: ("6g32h+pad", "4g32h+pad"),  # Danube, Phi-2-like: zero-padded to 96
    96: ("6g32h", "4g32h"),  # Phi-3-mini / Phi-3.5-mini
    128: ("6g64h", "4g64h"),
    192: ("6g64h", "4g64h"),  # DeepSeek-V2/V3 MLA keys (128 nope + 64 rope)
    256: ("6g64h", "4g64h"),  # Gemma 3
}


def test_the_default_format_fits_every_head_width_by_a_pinned_rule() -> None:
    fmt = kv_format(4)
    got = {}
    for d in DEFAULT_BY_WIDTH:
        fitted = fmt.for_dims(d, d)
        assert fitted.label.startswith("k") and fitted.head_tokens == fmt.head_tokens
        got[d] = tuple(c.label + ("+pad" if c.padded else "") for c in (fitted.keys, fitted.values))
    assert got == DEFAULT_BY_WIDTH
    assert fmt.for_dims(64, 64) == fmt  # the widths it was made for: unchanged
    assert kv_format(None).for_dims(80, 80) == kv_format(None)


@pytest.mark.parametrize("d", sorted(DEFAULT_BY_WIDTH))
def test_every_head_width_round_trips_in_the_default_format(d: int) -> None:
    fitted = kv_format(4).for_dims(d, d)
    k, v = _kv(d=d)
    for x, codec in ((k, fitted.keys), (v, fitted.values)):
        parts = codec.encode(x)
        back = codec.decode(parts, mx.float32)
        assert back.shape == x.shape  # padding cut away
        if codec.rotate:
            back = back @ rotation(d).T
        assert _rel(back, x) < (0.03 if codec.bits == 6 else 0.12)


@pytest.mark.parametrize("serve_stored", [False, True])
@pytest.mark.parametrize("d", [80, 96, 192])
def test_attention_over_odd_head_widths_is_as_faithful_as_over_64(d: int, serve_stored: bool) -> None:
    base = _attention_error(kv_format(4), 1, 64, serve_stored)
    assert _attention_error(kv_format(4), 1, d, serve_stored) < max(2 * base, 0.02)


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


HEAD4 = KVQuant(TensorCodec(4, rotate=True), TensorCodec(4, rotate=True), head_tokens=4)


def _committed_in_pieces(kv: KVQuant, pieces: list[int]) -> LayerCache:
    k, v = _kv(n=sum(pieces))
    cache = LayerCache(LayerSpec(kv_heads=2, k_head_dim=64, v_head_dim=64, window=None), kv, mx.float32)
    a = 0
    for n in pieces:
        cache.update_and_fetch(k[:, :, a : a + n], v[:, :, a : a + n])
        cache.commit()
        a += n
    return cache


def test_head_tokens_are_kept_exactly_however_the_commits_fall() -> None:
    k, _ = _kv(n=300)
    for pieces in ([300], [2, 1, 297], [4, 296], [3, 5, 292]):
        cache = _committed_in_pieces(HEAD4, pieces)
        assert cache.n_head == 4 and cache.body_start == 4 and cache.offset == 300
        np.testing.assert_array_equal(np.array(cache.head_k), np.array(k[:, :, :4].astype(mx.float16)))
        assert cache.keys is not None and cache.keys[0].shape[2] == 296
    one = _committed_in_pieces(HEAD4, [300])
    split = _committed_in_pieces(HEAD4, [3, 5, 292])
    assert one.keys is not None and split.keys is not None
    for a, b in zip(one.keys, split.keys, strict=True):  # per-token quantization: same bytes
        np.testing.assert_array_equal(np.array(a), np.array(b))


def test_head_tokens_through_slice_trim_drop_and_load() -> None:
    cache = _committed_in_pieces(HEAD4, [300])
    head, body = cache.committed_slice(0, 256)  # block 0: the head and 252 body tokens
    assert head is not None and head[0].shape[2] == 4 and body is not None and body[0][0].shape[2] == 252
    head, body = cache.committed_slice(256, 300)
    assert head is None and body is not None and body[0][0].shape[2] == 44
    # A reload from the two blocks' tensors attends exactly like the cache it came from.
    h0, b0 = cache.committed_slice(0, 256)
    _, b1 = cache.committed_slice(256, 300)
    assert h0 is not None and b0 is not None and b1 is not None
    joined = tuple(
        tuple(mx.concatenate([x, y], axis=2) for x, y in zip(p, q, strict=True))
        for p, q in zip(b0, b1, strict=True)
    )
    loaded = LayerCache(cache.spec, HEAD4, mx.float32)
    loaded.load(0, h0, *joined)
    q = mx.random.normal((1, 6, 1, 64), key=mx.random.key(2))
    for c in (cache, loaded):
        k1, v1 = _kv(n=1)
        c.update_and_fetch(k1, v1)
    np.testing.assert_array_equal(np.array(cache.attend(q, 0.125)), np.array(loaded.attend(q, 0.125)))
    for c in (cache, loaded):
        c.commit()
        c.trim_to(300)  # drop the probe token again
    loaded.trim_to(2)  # inside the head
    assert loaded.n_head == 2 and loaded.keys is None and loaded.offset == 2
    cache.drop_before(2)  # would split the head: nothing is freed
    assert cache.start == 0 and cache.n_head == 4
    cache.drop_before(100)
    assert cache.start == 100 and cache.head_k is None and cache.keys is not None
    assert cache.keys[0].shape[2] == 200


def test_head_tokens_cut_the_error_of_an_attention_sink() -> None:
    """One key that most queries attend to (a sink) with a value far from the rest: its
    4-bit error is not averaged away; kept at 16 bits, the output error drops."""
    k, v = _kv()
    k = k.at[:, :, 0].add(40.0 * mx.ones((64,)) / 8)
    v = v.at[:, :, 0].multiply(6.0)
    spec = LayerSpec(kv_heads=2, k_head_dim=64, v_head_dim=64, window=None)
    plain = KVQuant(HEAD4.keys, HEAD4.values)
    outs = []
    for fmt in (KVQuant.uniform(None), plain, HEAD4):
        cache = LayerCache(spec, fmt, mx.float32)
        cache.update_and_fetch(k[:, :, :-1], v[:, :, :-1])
        cache.commit()
        cache.update_and_fetch(k[:, :, -1:], v[:, :, -1:])
        outs.append(cache.attend(mx.random.normal((1, 6, 1, 64), key=mx.random.key(1)) + 2.0, 0.125))
    assert _rel(outs[2], outs[0]) < 0.5 * _rel(outs[1], outs[0])


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_cpu_unpacking_equals_mlx_dequantize(bits: int, group_size: int, dtype: mx.Dtype) -> None:
    x = mx.random.normal((1, 3, 37, 128), key=mx.random.key(bits))
    q, scales, biases = mx.quantize(x, group_size=group_size, bits=bits)
    scales, biases = scales.astype(dtype), biases.astype(dtype)
    expected = mx.dequantize(q, scales, biases, group_size=group_size, bits=bits)
    got = unpack_affine(q, scales, biases, bits, group_size)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    assert mx.array_equal(got, expected).item()


def test_a_16bit_models_working_copy_stays_16bit_and_equals_a_reload() -> None:
    """A bf16 model (GPUs) with a rotated format: the kept working copy and one rebuilt from
    the stored blocks hold the same bf16 values (hot == warm), not a float32 promotion."""
    spec = LayerSpec(kv_heads=2, k_head_dim=64, v_head_dim=64, window=None)
    k, v = (x.astype(mx.bfloat16) for x in _kv())
    hot = LayerCache(spec, kv_format(4), mx.bfloat16)
    hot.update_and_fetch(k[:, :, :-1], v[:, :, :-1])
    hot.commit(keep_work=True)
    warm = LayerCache(spec, kv_format(4), mx.bfloat16)
    warm.from_blocks(0, 0, [hot.block_state(0, 0, hot.offset)], hot.offset)
    got = [c.update_and_fetch(k[:, :, -1:], v[:, :, -1:]) for c in (hot, warm)]
    for (a, b), want in zip(zip(*got, strict=True), (k, v), strict=True):
        assert a.dtype == b.dtype == mx.bfloat16 and a.shape == want.shape
        np.testing.assert_array_equal(np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32)))
