"""Faster CPU kernels for mlx-lm's attention and MLP activations (draft)."""

from __future__ import annotations

from functools import partial
from typing import Any

from .runtime import mx

_LOG2E = 1.4426950408889634
_LN2_HI = 0.693145751953125
_LN2_LO = 1.428606765330187e-06
_MAGIC = 12582912.0  # 1.5 * 2**23
_EXP_LO = -88.0
_EXP_HI = 88.0
_P = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)


@partial(mx.compile, shapeless=True)
def _exp_parts(x: mx.array) -> tuple[mx.array, mx.array]:
    x = mx.minimum(mx.maximum(x, _EXP_LO), _EXP_HI)
    n = (x * _LOG2E + _MAGIC) - _MAGIC
    r = (x - n * _LN2_HI) - n * _LN2_LO
    z = r * r
    p = ((((_P[0] * r + _P[1]) * r + _P[2]) * r + _P[3]) * r + _P[4]) * r + _P[5]
    p = p * z + r + 1.0
    return p, (n.astype(mx.int32) + 127) << 23


@partial(mx.compile, shapeless=True)
def _mul(a: mx.array, b: mx.array) -> mx.array:
    return a * b


def fast_exp(x: mx.array) -> mx.array:
    p, bits = _exp_parts(x.astype(mx.float32))
    return _mul(p, bits.view(mx.float32))


def attention(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any = None
) -> mx.array:
    B, H, L, D = queries.shape
    KV, kL = keys.shape[1], keys.shape[2]
    n_rep = H // KV
    Dv = values.shape[-1]
    q = (queries.astype(mx.float32) * scale).reshape(B, KV, n_rep * L, D)
    s = (q @ keys.astype(mx.float32).swapaxes(-1, -2)).reshape(B, KV, n_rep, L, kL)
    if mask is not None:
        if isinstance(mask, str):
            mask = mx.arange(kL - L, kL)[:, None] >= mx.arange(kL)[None]
        if mask.ndim == 3:
            mask = mask[None]
        if mask.ndim == 4:
            if mask.shape[1] == 1:
                mask = mx.expand_dims(mask, 2)
            else:
                mask = mask.reshape(mask.shape[0], KV, n_rep, *mask.shape[2:])
        if mask.dtype == mx.bool_:
            s = mx.where(mask, s, mx.finfo(mx.float32).min)
        else:
            s = s + mask.astype(mx.float32)
    m = s.max(-1, keepdims=True)
    e = fast_exp(s - m)
    den = e.sum(-1, keepdims=True)
    o = e.reshape(B, KV, n_rep * L, kL) @ values.astype(mx.float32)
    o = o.reshape(B, KV, n_rep, L, Dv) / den
    return o.reshape(B, H, L, Dv).astype(queries.dtype)
