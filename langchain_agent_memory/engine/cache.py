"""Per-layer KV caches: a committed part stored compactly (4-bit, 8-bit or 16-bit) and a
pending part at full precision for the tokens of the request being run.

Why two parts: every token's keys and values are quantized independently (per token,
per head, per group of 64 channels), so *when* a token is quantized does not change its
stored value. Tokens of the running request stay at full precision until the request
ends (``commit``): prefill then runs at full-precision speed on CPU (the 4-bit attention
path was 3.3x slower there), and what is committed — and written to disk — is exactly
what a later request, in this process or another, attends to. Hot and warm runs are
therefore identical.

Attention over a ``LayerCache`` goes through ``attend`` (installed into mlx-lm's models by
``install_attention_hook``). The mask is built here, from positions, for every layer:
causal, and for sliding-window layers also ``query - key < window`` — a causal-only mask
on a sliding layer that keeps more than ``window`` tokens is silently wrong.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from .runtime import mx
from .spec import LayerSpec, ModelCacheSpec

#: Scales and biases are stored (on disk and in memory) at 16 bits: 0.281x FP16 bytes at
#: 4 bits / group 64, instead of 0.3125x with float32 scales.
SCALE_DTYPE = mx.float16
#: Keys and values at 16 bits ("FP16 mode"): float16.
HALF_DTYPE = mx.float16
#: Below this many queries (decode, short tails) attention multiplies the packed 4/8-bit
#: tensors directly; above it (prefill chunks) the layer's keys are dequantized for BLAS.
DEQUANTIZE_MIN_QUERIES = 16


@functools.cache
def rotation(dim: int) -> mx.array:
    """A fixed orthonormal (dim, dim) rotation: random signs times a normalised Hadamard
    matrix (block-diagonal when ``dim`` is not a power of two).

    Rotating keys and queries alike leaves every score unchanged (q R . k R = q . k) while
    spreading outlier channels over the whole head, which is what hurts 4-bit groups. The
    signs come from a seed fixed per ``dim``: every process builds the same matrix.
    """
    block = dim & -dim  # largest power of two dividing dim
    if block < 16:
        raise ValueError(f"head dim {dim} has no power-of-two block >= 16 to rotate")
    h = np.array([[1.0]])
    while h.shape[0] < block:
        h = np.block([[h, h], [h, -h]])
    h /= np.sqrt(block)
    full = np.kron(np.eye(dim // block), h)
    signs = np.random.default_rng(dim).choice([-1.0, 1.0], size=dim)
    return mx.array((signs[:, None] * full).astype(np.float32))


@dataclass(frozen=True, slots=True)
class TensorCodec:
    """How one of K or V is stored: ``bits=None`` is float16; else affine ``bits``-bit
    groups of ``group_size`` channels with float16 scales and biases, optionally after the
    fixed rotation of the head dimension (``rotate``)."""

    bits: int | None = 4
    group_size: int = 64
    rotate: bool = False

    def __post_init__(self) -> None:
        if self.bits not in (None, 2, 3, 4, 6, 8):
            raise ValueError(f"kv bits must be 4, 8 (or 2, 3, 6) or None for 16-bit; got {self.bits!r}")
        if self.group_size not in (32, 64, 128):
            raise ValueError(f"group_size must be 32, 64 or 128; got {self.group_size}")

    @property
    def label(self) -> str:
        if self.bits is None:
            return "f16" + ("h" if self.rotate else "")
        return f"{self.bits}g{self.group_size}" + ("h" if self.rotate else "")

    def parts(self) -> tuple[str, ...]:
        return ("",) if self.bits is None else ("q", "scales", "biases")

    def encode(self, x: mx.array) -> tuple[mx.array, ...]:
        """Full precision (B, H, N, D) -> stored form (tuple of arrays, last axis packed)."""
        if self.rotate:
            x = x.astype(mx.float32) @ rotation(x.shape[-1])
        if self.bits is None:
            return (x.astype(HALF_DTYPE),)
        q, scales, biases = mx.quantize(x, group_size=self.group_size, bits=self.bits)
        return q, scales.astype(SCALE_DTYPE), biases.astype(SCALE_DTYPE)

    def decode(self, parts: tuple[mx.array, ...], dtype: mx.Dtype) -> mx.array:
        """Stored form -> full precision, still rotated if ``rotate`` (per layer and call)."""
        if self.bits is None:
            return parts[0].astype(dtype)
        q, scales, biases = parts
        return mx.dequantize(
            q, scales.astype(dtype), biases.astype(dtype), group_size=self.group_size, bits=self.bits
        )


@dataclass(frozen=True, slots=True)
class KVQuant:
    """How committed keys and values are stored (see ``KV_PRESETS``)."""

    keys: TensorCodec = TensorCodec()
    values: TensorCodec = TensorCodec()

    @classmethod
    def uniform(cls, bits: int | None, group_size: int = 64, rotate: bool = False) -> KVQuant:
        codec = TensorCodec(bits, group_size, rotate)
        return cls(codec, codec)

    @property
    def label(self) -> str:
        return f"k{self.keys.label}-v{self.values.label}"


#: Named KV formats (``Engine(kv="...")``). ``q4`` is what the reference system measured.
KV_PRESETS: dict[str, KVQuant] = {
    "fp16": KVQuant.uniform(None),
    "q8": KVQuant.uniform(8),
    "q4": KVQuant.uniform(4),
    "q4g32": KVQuant.uniform(4, 32),
    "q4-rot": KVQuant.uniform(4, rotate=True),
    "k8v4": KVQuant(TensorCodec(8), TensorCodec(4)),
    "k8v4-rot": KVQuant(TensorCodec(8, rotate=True), TensorCodec(4, rotate=True)),
}


def kv_format(kv: str | KVQuant | int | None) -> KVQuant:
    """A ``KVQuant`` from a preset name, a bit width (4, 8; None = 16-bit) or itself."""
    if isinstance(kv, KVQuant):
        return kv
    if isinstance(kv, str):
        if kv not in KV_PRESETS:
            raise ValueError(f"unknown KV format {kv!r}; choose one of {sorted(KV_PRESETS)}")
        return KV_PRESETS[kv]
    return KVQuant.uniform(kv)


def _concat(a: tuple[mx.array, ...] | None, b: tuple[mx.array, ...]) -> tuple[mx.array, ...]:
    if a is None:
        return b
    return tuple(mx.concatenate([x, y], axis=2) for x, y in zip(a, b, strict=True))


def _slice(parts: tuple[mx.array, ...], start: int, stop: int) -> tuple[mx.array, ...]:
    return tuple(p[:, :, start:stop] for p in parts)


class LayerCache:
    """One layer of one agent's cache (mlx-lm cache protocol: ``offset``,
    ``update_and_fetch``, ``make_mask``), positions ``[start, offset)`` held in memory."""

    def __init__(self, spec: LayerSpec, quant: KVQuant, dtype: mx.Dtype) -> None:
        self.spec = spec
        self.quant = quant
        self.dtype = dtype
        self.start = 0  # absolute position of the first token held in memory
        self.offset = 0  # absolute position after the last token
        self.keys: tuple[mx.array, ...] | None = None  # committed, stored form
        self.values: tuple[mx.array, ...] | None = None
        self.pending_k: mx.array | None = None  # this request's tokens, full precision
        self.pending_v: mx.array | None = None

    # ---------------------------------------------------------------- sizes

    @property
    def committed_end(self) -> int:
        return self.offset - (0 if self.pending_k is None else self.pending_k.shape[2])

    @property
    def nbytes(self) -> int:
        arrays = [*(self.keys or ()), *(self.values or ())]
        arrays += [a for a in (self.pending_k, self.pending_v) if a is not None]
        return sum(int(a.nbytes) for a in arrays)

    # ---------------------------------------------------------------- mlx-lm protocol

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[LayerCache, LayerCache]:
        if self.pending_k is None:
            self.pending_k, self.pending_v = keys, values
        else:
            assert self.pending_v is not None
            self.pending_k = mx.concatenate([self.pending_k, keys], axis=2)
            self.pending_v = mx.concatenate([self.pending_v, values], axis=2)
        self.offset += keys.shape[2]
        # mlx-lm passes these on to its attention function; ours (installed by
        # install_attention_hook) recognises the cache and calls ``attend``.
        return self, self

    def make_mask(self, *args: Any, **kwargs: Any) -> None:
        return None  # masks are built in ``attend``, from positions and the layer's window

    def is_trimmable(self) -> bool:
        return True

    @property
    def state(self) -> tuple[Any, ...]:
        return (self.keys, self.values, self.pending_k, self.pending_v)

    # ---------------------------------------------------------------- attention

    def attend(self, queries: mx.array, scale: float) -> mx.array:
        """Attention of ``queries`` (the last L positions) over every visible key."""
        L = queries.shape[2]
        window = self.spec.window
        first_q = self.offset - L
        # Keys a sliding-window layer can no longer see are not even read.
        lo = self.start if window is None else max(self.start, first_q - window + 1)
        committed = None
        if self.keys is not None and self.values is not None and lo < self.committed_end:
            a, b = lo - self.start, self.committed_end - self.start
            committed = (_slice(self.keys, a, b), _slice(self.values, a, b))
        pending = None
        if self.pending_k is not None and self.pending_v is not None:
            skip = max(0, lo - self.committed_end)
            pending = (self.pending_k[:, :, skip:], self.pending_v[:, :, skip:])
        if L < DEQUANTIZE_MIN_QUERIES:
            return self._attend_small(queries, scale, committed, pending, first_q)
        # A prefill chunk: this layer's visible keys at full precision for one BLAS matmul
        # (the 4-bit kernels are several times slower on CPU); freed after the call. With
        # a rotated codec everything is moved into the rotated space (queries and this
        # request's keys / values: L rows) rather than the stored keys out of it (N rows).
        kc, vc = self.quant.keys, self.quant.values
        dtype = queries.dtype
        q = queries @ rotation(queries.shape[-1]) if kc.rotate else queries
        ks, vs = [], []
        if committed is not None:
            ks.append(kc.decode(committed[0], dtype))
            vs.append(vc.decode(committed[1], dtype))
        if pending is not None:
            pk, pv = pending[0].astype(dtype), pending[1].astype(dtype)
            ks.append(pk @ rotation(pk.shape[-1]) if kc.rotate else pk)
            vs.append(pv @ rotation(pv.shape[-1]) if vc.rotate else pv)
        k = ks[0] if len(ks) == 1 else mx.concatenate(ks, axis=2)
        v = vs[0] if len(vs) == 1 else mx.concatenate(vs, axis=2)
        out = _sdpa(q, k, v, scale, self._mask(first_q, L, k.shape[2]))
        return out @ rotation(out.shape[-1]).T if vc.rotate else out

    def _mask(self, first_q: int, L: int, n_keys: int) -> mx.array | None:
        """Causal and, for sliding layers, window mask over the keys that were read."""
        first_k = self.offset - n_keys
        if L == 1 and (self.spec.window is None or n_keys <= self.spec.window):
            return None  # one query sees every key that was read
        q_pos = mx.arange(first_q, self.offset)[:, None]
        k_pos = mx.arange(first_k, self.offset)[None]
        mask = k_pos <= q_pos
        if self.spec.window is not None:
            mask = mask & (q_pos - k_pos < self.spec.window)
        return mask

    def _attend_small(
        self,
        queries: mx.array,
        scale: float,
        committed: tuple[tuple[mx.array, ...], tuple[mx.array, ...]] | None,
        pending: tuple[mx.array, mx.array] | None,
        first_q: int,
    ) -> mx.array:
        """Decode-sized attention straight on the stored (packed 4/8-bit) keys and values
        (``mx.quantized_matmul``), with this request's full-precision tokens beside them."""
        B, H, L, D = queries.shape
        kv = self.spec.kv_heads
        rep = H // kv
        dtype = queries.dtype
        kc, vc = self.quant.keys, self.quant.values
        q = (queries * scale).reshape(B, kv, rep * L, D)
        scores, sizes = [], []
        if committed is not None:
            qk = q @ rotation(D) if kc.rotate else q
            scores.append(_matmul_stored(qk, committed[0], kc, dtype, transpose=True))
            sizes.append(committed[0][0].shape[2])
        if pending is not None:
            scores.append(q @ pending[0].astype(dtype).swapaxes(-1, -2))
            sizes.append(pending[0].shape[2])
        s = scores[0] if len(scores) == 1 else mx.concatenate(scores, axis=-1)
        mask = self._mask(first_q, L, sum(sizes))
        if mask is not None:
            s = s.reshape(B, kv, rep, L, -1)
            s = mx.where(mask, s, mx.finfo(s.dtype).min).reshape(B, kv, rep * L, -1)
        w = mx.softmax(s, axis=-1, precise=True)
        out = None
        if committed is not None:
            out = _matmul_stored(w[..., : sizes[0]], committed[1], vc, dtype, transpose=False)
            if vc.rotate:
                out = out @ rotation(out.shape[-1]).T
        if pending is not None:
            part = w[..., sum(sizes[:-1]) :] @ pending[1].astype(dtype)
            out = part if out is None else out + part
        assert out is not None
        return out.reshape(B, H, L, -1)

    # ---------------------------------------------------------------- lifecycle

    def commit(self) -> None:
        """Move this request's tokens into the committed (stored) form."""
        if self.pending_k is None or self.pending_v is None:
            return
        self.keys = _concat(self.keys, self.quant.keys.encode(self.pending_k))
        self.values = _concat(self.values, self.quant.values.encode(self.pending_v))
        self.pending_k = self.pending_v = None

    def committed_slice(self, a: int, b: int) -> tuple[tuple[mx.array, ...], tuple[mx.array, ...]]:
        """Stored K and V of absolute positions [a, b) (must be committed and in memory)."""
        if not (self.start <= a <= b <= self.committed_end) or self.keys is None or self.values is None:
            raise RuntimeError(
                f"positions [{a}, {b}) not committed in memory [{self.start}, {self.committed_end})"
            )
        return _slice(self.keys, a - self.start, b - self.start), _slice(
            self.values, a - self.start, b - self.start
        )

    def drop_before(self, position: int) -> None:
        """Free committed tokens before ``position`` (sliding layers past their window)."""
        cut = min(position, self.committed_end) - self.start
        if cut <= 0 or self.keys is None or self.values is None:
            return
        n = self.committed_end - self.start
        self.keys, self.values = _slice(self.keys, cut, n), _slice(self.values, cut, n)
        self.start += cut

    def trim_to(self, n_tokens: int) -> None:
        """Keep positions < ``n_tokens`` (committed tokens only; ``start <= n_tokens``)."""
        if self.pending_k is not None:
            raise RuntimeError("trim_to with pending tokens: commit first (this is a bug)")
        if n_tokens < self.start:
            raise RuntimeError("cannot trim below the first token in memory; rebuild from blocks")
        if self.keys is not None and self.values is not None:
            keep = n_tokens - self.start
            self.keys, self.values = _slice(self.keys, 0, keep), _slice(self.values, 0, keep)
        self.offset = n_tokens

    def load(self, start: int, keys: tuple[mx.array, ...], values: tuple[mx.array, ...]) -> None:
        """Set committed contents to positions [start, start + N) in stored form."""
        self.start, self.keys, self.values = start, keys, values
        self.offset = start + keys[0].shape[2]
        self.pending_k = self.pending_v = None


def _matmul_stored(
    x: mx.array, parts: tuple[mx.array, ...], codec: TensorCodec, dtype: mx.Dtype, transpose: bool
) -> mx.array:
    """``x @ W.T`` (transpose) or ``x @ W`` for W in its stored form, without unpacking it."""
    if codec.bits is None:
        w = parts[0].astype(dtype)
        return x @ (w.swapaxes(-1, -2) if transpose else w)
    q, scales, biases = parts
    return mx.quantized_matmul(
        x, q, scales.astype(dtype), biases.astype(dtype), transpose, codec.group_size, codec.bits
    )


def _sdpa(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array) -> mx.array:
    from . import fast_ops

    return fast_ops.attention(q, k, v, scale=scale, mask=mask)


def make_layer_caches(spec: ModelCacheSpec, quant: KVQuant) -> list[LayerCache]:
    dtype = getattr(mx, spec.dtype)
    return [LayerCache(s, quant, dtype) for s in spec.layers]


_HOOKED_MODULES = ("mlx_lm.models.llama", "mlx_lm.models.gemma3_text", "mlx_lm.models.deepseek_v2")


def install_attention_hook() -> None:
    """Route mlx-lm's attention to ``LayerCache.attend`` when the cache is ours (idempotent;
    any other cache goes to the function that was installed before)."""
    import importlib

    for name in _HOOKED_MODULES:
        module = importlib.import_module(name)
        previous = module.scaled_dot_product_attention
        if getattr(previous, "_agent_memory_hook", False):
            continue

        def hooked(queries, keys, values, cache, scale, mask, sinks=None, _previous=previous):  # type: ignore[no-untyped-def]
            if isinstance(cache, LayerCache):
                return cache.attend(queries, scale)
            return _previous(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

        hooked._agent_memory_hook = True  # type: ignore[attr-defined]
        module.scaled_dot_product_attention = hooked
