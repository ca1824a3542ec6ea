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

from dataclasses import dataclass
from typing import Any

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


@dataclass(frozen=True, slots=True)
class KVQuant:
    """How committed K/V are stored. ``bits=None``: 16-bit floats."""

    bits: int | None = 4
    group_size: int = 64

    def __post_init__(self) -> None:
        if self.bits not in (None, 2, 3, 4, 6, 8):
            raise ValueError(f"kv_bits must be 4, 8 (or 2, 3, 6) or None for 16-bit; got {self.bits!r}")
        if self.group_size not in (32, 64, 128):
            raise ValueError(f"group_size must be 32, 64 or 128; got {self.group_size}")

    @property
    def label(self) -> str:
        return "fp16" if self.bits is None else f"q{self.bits}g{self.group_size}"

    def parts(self) -> tuple[str, ...]:
        return ("",) if self.bits is None else ("q", "scales", "biases")

    def encode(self, x: mx.array) -> tuple[mx.array, ...]:
        """Full-precision (B, H, N, D) -> stored form (tuple of arrays, last axes packed)."""
        if self.bits is None:
            return (x.astype(HALF_DTYPE),)
        q, scales, biases = mx.quantize(x, group_size=self.group_size, bits=self.bits)
        return q, scales.astype(SCALE_DTYPE), biases.astype(SCALE_DTYPE)

    def decode(self, parts: tuple[mx.array, ...], dtype: mx.Dtype) -> mx.array:
        """Stored form -> full precision (used per layer and per call, never kept)."""
        if self.bits is None:
            return parts[0].astype(dtype)
        q, scales, biases = parts
        return mx.dequantize(
            q, scales.astype(dtype), biases.astype(dtype), group_size=self.group_size, bits=self.bits
        )


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
        if L < DEQUANTIZE_MIN_QUERIES and self.quant.bits is not None:
            return self._attend_quantized(queries, scale, committed, pending, first_q)
        # A prefill chunk: this layer's visible keys at full precision for one BLAS matmul
        # (the 4-bit kernels are several times slower on CPU); freed after the call.
        ks, vs = [], []
        if committed is not None:
            ks.append(self.quant.decode(committed[0], queries.dtype))
            vs.append(self.quant.decode(committed[1], queries.dtype))
        if pending is not None:
            ks.append(pending[0].astype(queries.dtype))
            vs.append(pending[1].astype(queries.dtype))
        k = ks[0] if len(ks) == 1 else mx.concatenate(ks, axis=2)
        v = vs[0] if len(vs) == 1 else mx.concatenate(vs, axis=2)
        return _sdpa(queries, k, v, scale, self._mask(first_q, L, k.shape[2]))

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

    def _attend_quantized(
        self,
        queries: mx.array,
        scale: float,
        committed: tuple[tuple[mx.array, ...], tuple[mx.array, ...]] | None,
        pending: tuple[mx.array, mx.array] | None,
        first_q: int,
    ) -> mx.array:
        """Decode-sized attention straight on the packed 4/8-bit keys and values
        (``mx.quantized_matmul``), with this request's full-precision tokens beside them."""
        B, H, L, D = queries.shape
        kv = self.spec.kv_heads
        rep = H // kv
        dtype = queries.dtype
        q = (queries * scale).reshape(B, kv, rep * L, D)
        gs, bits = self.quant.group_size, self.quant.bits
        scores, sizes = [], []
        if committed is not None:
            kq, ks, kb = committed[0]
            scores.append(mx.quantized_matmul(q, kq, ks.astype(dtype), kb.astype(dtype), True, gs, bits))
            sizes.append(kq.shape[2])
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
        at = 0
        if committed is not None:
            vq, vs, vb = committed[1]
            wc = w[..., : sizes[0]]
            out = mx.quantized_matmul(wc, vq, vs.astype(dtype), vb.astype(dtype), False, gs, bits)
            at = sizes[0]
        if pending is not None:
            part = w[..., at:] @ pending[1].astype(dtype)
            out = part if out is None else out + part
        assert out is not None
        return out.reshape(B, H, L, -1)

    # ---------------------------------------------------------------- lifecycle

    def commit(self) -> None:
        """Move this request's tokens into the committed (stored) form."""
        if self.pending_k is None or self.pending_v is None:
            return
        self.keys = _concat(self.keys, self.quant.encode(self.pending_k))
        self.values = _concat(self.values, self.quant.encode(self.pending_v))
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
