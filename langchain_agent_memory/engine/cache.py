"""Per-layer KV caches: a committed part stored compactly (4-bit, 8-bit or 16-bit) and a
pending part at full precision for the tokens of the request being run.

Why two parts: every token's keys and values are quantized independently (per token,
per head, per group of 64 channels), so *when* a token is quantized does not change its
stored value. Tokens of the running request stay at full precision until the request
ends (``commit``): prefill then runs at full-precision speed on CPU (the 4-bit attention
path was 3.3x slower there), and what is committed — and written to disk — is exactly
what a later request, in this process or another, attends to. Hot and warm runs are
therefore identical.

A ``LayerCache`` satisfies mlx-lm's cache protocol: ``update_and_fetch`` returns the
visible keys and values as real arrays, ``make_mask`` the mask for them (causal, and for
sliding-window layers also ``query - key < window``: a causal-only mask on a sliding layer
that keeps more than ``window`` tokens is silently wrong). Any mlx-lm attention runs on it
unchanged; on a GPU that is mlx's fused kernel. On the CPU a model adapted by
``adapters.adapt_model`` calls ``attend`` instead: BLAS attention on the working copy, with
a prefill in the codec's rotated space.
"""

from __future__ import annotations

import functools
import hashlib
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
#: The working copy of a running request's visible K/V grows by this many positions.
WORK_STEP = 256


#: How ``rotation`` derives its signs; part of every model fingerprint (``KVQuant.identity``):
#: stored rotated caches are only valid under the scheme that wrote them.
ROTATION_SCHEME = "hadamard-shake256-v1"


def rotation_signs(dim: int) -> np.ndarray:
    """``dim`` signs (+1 / -1) from SHAKE-256 of the scheme and ``dim``: the same in every
    process and every NumPy version (a NumPy RNG stream is not promised stable)."""
    raw = hashlib.shake_256(f"langchain-agent-memory/{ROTATION_SCHEME}/{dim}".encode()).digest(-(-dim // 8))
    bits = np.unpackbits(np.frombuffer(raw, dtype=np.uint8), bitorder="little")[:dim]
    return np.where(bits == 1, 1.0, -1.0)


@functools.cache
def rotation(dim: int) -> mx.array:
    """A fixed orthonormal (dim, dim) rotation: fixed signs times a normalised Hadamard
    matrix (block-diagonal when ``dim`` is not a power of two).

    Rotating keys and queries alike leaves every score unchanged (q R . k R = q . k) while
    spreading outlier channels over the whole head, which is what hurts 4-bit groups. The
    signs come from ``rotation_signs``: every process builds the same matrix.
    """
    block = dim & -dim  # largest power of two dividing dim
    if block < 16:
        raise ValueError(f"head dim {dim} has no power-of-two block >= 16 to rotate")
    h = np.array([[1.0]])
    while h.shape[0] < block:
        h = np.block([[h, h], [h, -h]])
    h /= np.sqrt(block)
    full = np.kron(np.eye(dim // block), h)
    return mx.array((rotation_signs(dim)[:, None] * full).astype(np.float32))


@dataclass(frozen=True, slots=True)
class TensorCodec:
    """How one of K or V is stored: ``bits=None`` is float16; else affine ``bits``-bit
    groups of ``group_size`` channels with float16 scales and biases, optionally after the
    fixed rotation of the head dimension (``rotate``)."""

    bits: int | None = 4
    group_size: int = 64
    rotate: bool = False

    def __post_init__(self) -> None:
        if self.bits not in (None, 2, 3, 4, 5, 6, 8):
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
        if mx.default_device() == mx.cpu:
            return unpack_affine(q, scales.astype(dtype), biases.astype(dtype), self.bits, self.group_size)
        return mx.dequantize(
            q, scales.astype(dtype), biases.astype(dtype), group_size=self.group_size, bits=self.bits
        )


def unpack_affine(q: mx.array, scales: mx.array, biases: mx.array, bits: int, group_size: int) -> mx.array:
    """``mx.dequantize`` on CPU, as vectorised shifts and masks: mlx's CPU kernel unpacks
    one value at a time (6-bit keys of a 2.3K-token layer took 5.2 ms, this 0.9 ms; 4-bit
    0.9 -> 0.7 ms), and a short prefill over a long cache dequantizes every layer.

    mlx packs values as a little-endian bit stream: ``lcm(bits, 8)`` bits hold a whole
    number of values (3 and 6 bits: 3 bytes; 5 bits: 5 bytes; 2, 4, 8 bits: any word).
    """
    lead = q.shape[:-1]
    if 32 % bits == 0:
        words, per_word, word_type = q, 32 // bits, mx.uint32
    else:
        run_bytes = int(np.lcm(bits, 8)) // 8
        word_type = mx.uint32 if run_bytes <= 4 else mx.uint64
        by = mx.view(q, mx.uint8).reshape(*lead, -1, run_bytes).astype(word_type)
        words = by[..., 0]
        for j in range(1, run_bytes):
            words = words | (by[..., j] << (8 * j))
        per_word = run_bytes * 8 // bits
    shifts = mx.arange(0, per_word * bits, bits, dtype=word_type)
    values = ((words[..., None] >> shifts) & ((1 << bits) - 1)).astype(scales.dtype)
    values = values.reshape(*lead, scales.shape[-1], group_size)
    return (values * scales[..., None] + biases[..., None]).reshape(*lead, -1)


@dataclass(frozen=True, slots=True)
class KVQuant:
    """How committed keys and values are stored (see ``KV_PRESETS``).

    ``head_tokens``: the first tokens of every sequence are kept at 16 bits. Most heads
    park much of their attention on them (attention sinks), so their quantization error is
    not averaged away over many keys the way every other token's is; at 4 bits it alone
    moved SmolLM2's greedy output off the 16-bit one on several prompts (README, KV formats).
    """

    keys: TensorCodec = TensorCodec()
    values: TensorCodec = TensorCodec()
    head_tokens: int = 0

    @classmethod
    def uniform(cls, bits: int | None, group_size: int = 64, rotate: bool = False) -> KVQuant:
        codec = TensorCodec(bits, group_size, rotate)
        return cls(codec, codec)

    @property
    def label(self) -> str:
        head = f"-h{self.head_tokens}" if self.head_tokens and self.keys.bits is not None else ""
        return f"k{self.keys.label}-v{self.values.label}{head}"

    @property
    def identity(self) -> str:
        """What a stored cache depends on beyond the label: the rotation's derivation."""
        rotated = self.keys.rotate or self.values.rotate
        return self.label + (f"+{ROTATION_SCHEME}" if rotated else "")

    def check_dims(self, k_dim: int, v_dim: int) -> None:
        """Refuse head widths this format cannot store (groups must tile the head)."""
        for what, dim, codec in (("key", k_dim, self.keys), ("value", v_dim, self.values)):
            if codec.bits is not None and dim % codec.group_size:
                raise ValueError(
                    f"KV format {self.label}: {what} heads are {dim} wide, not a multiple of its "
                    f"{codec.group_size}-channel groups; use kv_format='fp16' or a smaller group (q4g32)"
                )
            if codec.rotate and (dim & -dim) < 16:
                raise ValueError(
                    f"KV format {self.label}: {what} heads are {dim} wide, which cannot be rotated; "
                    "use an unrotated format (q8, q4)"
                )


#: 16-bit and unrotated: how head tokens are stored and pending tokens are held.
FULL = TensorCodec(None)

#: Named KV formats (``Engine(kv_format="...")``). ``q4`` is what the reference system
#: measured; the README lists each with its measured perplexity, agreement and bytes.
KV_PRESETS: dict[str, KVQuant] = {
    "fp16": KVQuant.uniform(None),
    "q8": KVQuant.uniform(8),
    "q4": KVQuant.uniform(4),
    "q4g32": KVQuant.uniform(4, 32),
    "q4-rot": KVQuant.uniform(4, rotate=True),
    "q4-rot-h4": KVQuant(TensorCodec(4, rotate=True), TensorCodec(4, rotate=True), head_tokens=4),
    "k6v4-rot-h4": KVQuant(TensorCodec(6, rotate=True), TensorCodec(4, rotate=True), head_tokens=4),
    "k8v4-rot": KVQuant(TensorCodec(8, rotate=True), TensorCodec(4, rotate=True)),
}


#: What ``kv_bits`` selects. 4: the best measured format at <= 0.35x the 16-bit bytes
#: (benchmarks/fidelity.py: plain ``q4`` moves greedy output off the 16-bit one within
#: ~5 tokens on most prompts of both shipped models; this one keeps >= 32 on 12 of 16).
KV_BITS_PRESET: dict[int | None, str] = {4: "k6v4-rot-h4", 8: "q8", None: "fp16"}


def kv_format(kv: str | KVQuant | int | None) -> KVQuant:
    """A ``KVQuant`` from a preset name, a ``kv_bits`` value (``KV_BITS_PRESET``: 4, 8 or
    None for 16-bit) or itself."""
    if isinstance(kv, KVQuant):
        return kv
    if isinstance(kv, str):
        if kv not in KV_PRESETS:
            raise ValueError(f"unknown KV format {kv!r}; choose one of {sorted(KV_PRESETS)}")
        return KV_PRESETS[kv]
    if kv not in KV_BITS_PRESET:
        raise ValueError(f"kv_bits must be 4, 8 or None (16-bit); got {kv!r}. Other formats: kv_format=")
    return KV_PRESETS[KV_BITS_PRESET[kv]]


Parts = tuple[mx.array, ...]
#: A run of consecutive visible tokens: K parts, V parts and the codecs they are stored in.
Segment = tuple[Parts, Parts, TensorCodec, TensorCodec]


def _concat(a: Parts | None, b: Parts) -> Parts:
    if a is None:
        return b
    return tuple(mx.concatenate([x, y], axis=2) for x, y in zip(a, b, strict=True))


def _slice(parts: Parts, start: int, stop: int) -> Parts:
    return tuple(p[:, :, start:stop] for p in parts)


def _in_space(x: mx.array, rotated: bool, want_rotated: bool) -> mx.array:
    """``x`` (rotated or not) moved into the rotated space or out of it, as wanted."""
    if rotated == want_rotated:
        return x
    return x @ rotation(x.shape[-1]) if want_rotated else x @ rotation(x.shape[-1]).T


@dataclass(slots=True)
class _Working:
    """A running request's visible K/V at full precision (rows ``[start, end)`` valid)."""

    k: mx.array
    v: mx.array
    start: int
    end: int
    krot: bool = False  # K rows in the keys codec's rotated space (during a prefill)
    vrot: bool = False


@dataclass(slots=True)
class _Fetched:
    """What ``update_and_fetch`` returned (``keys`` / ``values``, the model's space) and the
    working-copy view they came from (``k`` / ``v``, rotated where ``krot`` / ``vrot``)."""

    keys: mx.array
    values: mx.array
    k: mx.array
    v: mx.array
    krot: bool
    vrot: bool


def positional_mask(
    first_q: int, L: int, first_k: int, window: int | None, return_array: bool
) -> mx.array | str | None:
    """Queries at ``[first_q, first_q + L)`` over keys ``[first_k, first_q + L)``: causal and,
    with a ``window``, ``query - key < window``. None where every query sees every key;
    ``"causal"`` (bottom-right aligned, mlx's fused form) where that is all, unless an array
    is asked for."""
    end = first_q + L
    if L == 1 and (window is None or end - first_k <= window):
        return mx.ones((1, end - first_k), dtype=mx.bool_) if return_array else None
    if window is None and first_k == 0 and not return_array:
        return "causal"
    q_pos = mx.arange(first_q, end)[:, None]
    k_pos = mx.arange(first_k, end)[None]
    mask = k_pos <= q_pos
    if window is not None:
        mask = mask & (q_pos - k_pos < window)
    return mask


def cpu_attention(
    q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Any, sinks: mx.array | None = None
) -> mx.array:
    """Attention on the CPU: BLAS (``fast_ops.attention``); with attention sinks, mlx's op."""
    if sinks is not None:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)
    from . import fast_ops

    return fast_ops.attention(q, k, v, scale=scale, mask=mask)


class LayerCache:
    """One layer of one agent's cache (mlx-lm cache protocol: ``offset``,
    ``update_and_fetch``, ``make_mask``), positions ``[start, offset)`` held in memory:

    - head: positions ``[0, n_head)`` at 16 bits (``KVQuant.head_tokens``; only while
      ``start == 0``),
    - body: positions ``[body_start, committed_end)`` in the KV format,
    - pending: this request's tokens ``[committed_end, offset)`` at full precision.
    """

    def __init__(self, spec: LayerSpec, quant: KVQuant, dtype: mx.Dtype) -> None:
        self.spec = spec
        self.quant = quant
        self.dtype = dtype
        self.start = 0  # absolute position of the first token held in memory
        self.offset = 0  # absolute position after the last token
        self.head_k: mx.array | None = None  # committed first tokens, 16-bit
        self.head_v: mx.array | None = None
        self.keys: Parts | None = None  # committed, stored form
        self.values: Parts | None = None
        # This request's tokens at full precision, as appended (joined when read: a decode
        # step then costs no copy of them).
        self._pending: list[tuple[mx.array, mx.array]] = []
        self._n_pending = 0
        self._work: _Working | None = None  # see ``_visible``; dropped when the request ends
        self._fetched: _Fetched | None = None  # what the last ``update_and_fetch`` returned
        #: Prefill in the codec's rotated space (``attend``): set where an adapted model
        #: calls ``attend``; off, the working copy is kept in the model's own space.
        self.prefill_rotated = False

    # ---------------------------------------------------------------- sizes

    @property
    def committed_end(self) -> int:
        return self.offset - self._n_pending

    @property
    def pending_k(self) -> mx.array | None:
        return self._joined_pending()[0]

    @property
    def pending_v(self) -> mx.array | None:
        return self._joined_pending()[1]

    def set_pending(self, keys: mx.array | None, values: mx.array | None) -> None:
        """Replace this request's tokens (``offset`` is the caller's to keep right)."""
        self._pending = [] if keys is None or values is None else [(keys, values)]
        self._n_pending = 0 if keys is None else keys.shape[2]

    def _joined_pending(self) -> tuple[mx.array | None, mx.array | None]:
        if not self._pending:
            return None, None
        if len(self._pending) > 1:
            ks, vs = zip(*self._pending, strict=True)
            self._pending = [(mx.concatenate(ks, axis=2), mx.concatenate(vs, axis=2))]
        return self._pending[0]

    @property
    def n_head(self) -> int:
        return 0 if self.head_k is None else self.head_k.shape[2]

    @property
    def body_start(self) -> int:
        return self.start + self.n_head

    @property
    def nbytes(self) -> int:
        arrays = [*(self.keys or ()), *(self.values or ())]
        arrays += [a for a in (self.head_k, self.head_v) if a is not None]
        arrays += [a for pair in self._pending for a in pair]
        return sum(int(a.nbytes) for a in arrays)

    # ---------------------------------------------------------------- mlx-lm protocol

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append this step's keys and values; return every key and value the step's queries
        can see (a sliding layer's window), at full precision, in the model's space."""
        L = keys.shape[2]
        if self._work is not None and self._work.end == self.offset:
            self._append_work(keys, values)
        self.push_pending(keys, values)
        lo = self._first_visible(self.offset - L)
        k, v, krot, vrot = self._visible(lo, keys.dtype, rotated=self.prefill_rotated and L > 1)
        # Lazy: where ``attend`` is called instead (adapted model), these are never computed.
        out_k, out_v = _in_space(k, krot, False), _in_space(v, vrot, False)
        self._fetched = _Fetched(out_k, out_v, k, v, krot, vrot)
        return out_k, out_v

    def fetched(self, keys: Any, values: Any) -> bool:
        """Whether ``keys`` / ``values`` are what ``update_and_fetch`` just returned (an MLA
        layer may attend over arrays it derived from them instead)."""
        f = self._fetched
        return f is not None and keys is f.keys and values is f.values

    def push_pending(self, keys: mx.array, values: mx.array) -> None:
        """Add this request's new tokens (without touching the working copy)."""
        self._pending.append((keys, values))
        self._n_pending += keys.shape[2]
        self.offset += keys.shape[2]

    def make_mask(
        self, N: int, return_array: bool = False, window_size: int | None = None
    ) -> mx.array | str | None:
        """The mask of the next ``N`` queries over what ``update_and_fetch`` will return
        (this layer's own window; mlx-lm's ``window_size`` names the same one)."""
        first_q = self.offset
        lo = self._first_visible(first_q)
        return positional_mask(first_q, N, lo, self.spec.window, return_array)

    def _first_visible(self, first_q: int) -> int:
        """The first position a query at ``first_q`` or later can see (and is held)."""
        window = self.spec.window
        return self.start if window is None else max(self.start, first_q - window + 1)

    def is_trimmable(self) -> bool:
        return True

    @property
    def state(self) -> tuple[Any, ...]:
        return (self.head_k, self.head_v, self.keys, self.values, self._pending)

    # ---------------------------------------------------------------- attention

    def _segments(self, lo: int) -> list[Segment]:
        """The tokens from absolute position ``lo`` on, oldest first, as they are held."""
        segments: list[Segment] = []
        if self.head_k is not None and self.head_v is not None and lo < self.n_head:
            segments.append(((self.head_k[:, :, lo:],), (self.head_v[:, :, lo:],), FULL, FULL))
        b0, end = self.body_start, self.committed_end
        if self.keys is not None and self.values is not None and max(lo, b0) < end:
            a, b = max(lo, b0) - b0, end - b0
            segments.append(
                (_slice(self.keys, a, b), _slice(self.values, a, b), self.quant.keys, self.quant.values)
            )
        pk, pv = self._joined_pending()
        if pk is not None and pv is not None:
            skip = max(0, lo - end)
            segments.append(((pk[:, :, skip:],), (pv[:, :, skip:],), FULL, FULL))
        return segments

    def attend(self, queries: mx.array, scale: float, sinks: mx.array | None = None) -> mx.array:
        """Attention of ``queries`` (the last L positions) over what ``update_and_fetch``
        fetched (CPU path; see ``adapters``).

        Over the full-precision working copy (``_visible``), one BLAS attention: the 4-bit
        kernels are several times slower on CPU, and a decode step over stored segments took
        ~20 small ops per layer where this takes a few. With a rotated codec a prefill works
        in the rotated space (queries, head and this request's keys / values are rotated: few
        rows), so the first token never waits for the stored body to be rotated back; that
        happens once, at the first decode step.
        """
        f = self._fetched
        if f is None:
            raise RuntimeError("attend before update_and_fetch (this is a bug)")
        L = queries.shape[2]
        q = queries @ rotation(queries.shape[-1]) if f.krot else queries
        n_keys = f.k.shape[2]
        mask = positional_mask(self.offset - L, L, self.offset - n_keys, self.spec.window, False)
        out = cpu_attention(q, f.k, f.v, scale, mask, sinks)
        return out @ rotation(out.shape[-1]).T if f.vrot else out

    def _visible(self, lo: int, dtype: mx.Dtype, rotated: bool) -> tuple[mx.array, mx.array, bool, bool]:
        """Positions ``[lo, offset)`` at full precision, and whether K and V are in their
        codec's rotated space. Built once per request (the stored body unpacked), then kept
        in step by ``update_and_fetch`` until ``commit``: a chunked prefill or a decode step
        does not unpack the body again. ``rotated``: a prefill may stay in the rotated space;
        otherwise (a decode step) the copy is moved out of it, once."""
        w = self._work
        if w is None or w.start > lo or w.end != self.offset:
            krot, vrot = self.quant.keys.rotate and rotated, self.quant.values.rotate and rotated
            k, v = self._decoded(lo, dtype, krot, vrot)
            w = self._work = _Working(k, v, lo, self.offset, krot, vrot)
        elif not rotated and (w.krot or w.vrot):
            used = w.end - w.start
            w.k, w.v = _in_space(w.k[:, :, :used], w.krot, False), _in_space(w.v[:, :, :used], w.vrot, False)
            w.krot = w.vrot = False
        a, b = lo - w.start, w.end - w.start
        return w.k[:, :, a:b], w.v[:, :, a:b], w.krot, w.vrot

    def _decoded(self, lo: int, dtype: mx.Dtype, krot: bool, vrot: bool) -> tuple[mx.array, mx.array]:
        """Positions ``[lo, offset)`` as held, at full precision (in the rotated space
        where ``krot`` / ``vrot``)."""
        segments = self._segments(lo)
        ks = [_in_space(kc.decode(kp, dtype), kc.rotate, krot) for kp, _, kc, _ in segments]
        vs = [_in_space(vc.decode(vp, dtype), vc.rotate, vrot) for _, vp, _, vc in segments]
        k = ks[0] if len(ks) == 1 else mx.concatenate(ks, axis=2)
        v = vs[0] if len(vs) == 1 else mx.concatenate(vs, axis=2)
        return k, v

    @property
    def work_nbytes(self) -> int:
        """Bytes of the full-precision working copy (0 when none is kept)."""
        w = self._work
        return 0 if w is None else int(w.k.nbytes + w.v.nbytes)

    def drop_work(self) -> None:
        """Free the working copy (the next request unpacks the stored form again)."""
        self._work = None

    def _append_work(self, keys: mx.array, values: mx.array) -> None:
        w = self._work
        assert w is not None
        n, used = keys.shape[2], w.end - w.start
        if used + n > w.k.shape[2]:  # grow by whole steps: appends are then in place
            extra = -(-(used + n - w.k.shape[2]) // WORK_STEP) * WORK_STEP
            w.k = mx.concatenate(
                [w.k[:, :, :used], mx.zeros((*w.k.shape[:2], extra, w.k.shape[3]), w.k.dtype)], 2
            )
            w.v = mx.concatenate(
                [w.v[:, :, :used], mx.zeros((*w.v.shape[:2], extra, w.v.shape[3]), w.v.dtype)], 2
            )
        w.k[:, :, used : used + n] = _in_space(keys.astype(w.k.dtype), False, w.krot)
        w.v[:, :, used : used + n] = _in_space(values.astype(w.v.dtype), False, w.vrot)
        w.end += n

    # ---------------------------------------------------------------- lifecycle

    def commit(self, keep_work: bool = False) -> None:
        """Move this request's tokens into the committed (stored) form.

        ``keep_work``: keep the full-precision working copy for the agent's next request
        (which then unpacks nothing), with this request's rows replaced by what the stored
        form decodes to: the next request sees exactly what a reload from disk would.
        """
        k, v = self._joined_pending()
        if k is None or v is None:
            return
        first = self.committed_end
        n_head = max(0, min(self.quant.head_tokens, self.offset) - self.committed_end)
        if n_head and self.start == 0 and self.keys is None:
            hk, hv = k[:, :, :n_head].astype(HALF_DTYPE), v[:, :, :n_head].astype(HALF_DTYPE)
            self.head_k = hk if self.head_k is None else mx.concatenate([self.head_k, hk], axis=2)
            self.head_v = hv if self.head_v is None else mx.concatenate([self.head_v, hv], axis=2)
            k, v = k[:, :, n_head:], v[:, :, n_head:]
        if k.shape[2]:
            self.keys = _concat(self.keys, self.quant.keys.encode(k))
            self.values = _concat(self.values, self.quant.values.encode(v))
        self.set_pending(None, None)
        self._fetched = None
        w = self._work
        if not keep_work or w is None or w.end != self.offset or w.start > first:
            self._work = None  # the request is over: only the stored form stays in memory
            return
        dk, dv = self._decoded(first, w.k.dtype, w.krot, w.vrot)
        a, b = first - w.start, self.offset - w.start
        w.k[:, :, a:b] = dk
        w.v[:, :, a:b] = dv
        mx.eval(w.k, w.v)  # not a graph holding this request's arrays until the next one

    def committed_slice(
        self, a: int, b: int
    ) -> tuple[tuple[mx.array, mx.array] | None, tuple[Parts, Parts] | None]:
        """Stored (head K, V) and (body K parts, V parts) of absolute positions [a, b)
        (committed and in memory); either is None where the range has none of it."""
        if not (self.start <= a <= b <= self.committed_end):
            raise RuntimeError(
                f"positions [{a}, {b}) not committed in memory [{self.start}, {self.committed_end})"
            )
        head = body = None
        if self.head_k is not None and self.head_v is not None and a < self.n_head:
            z = min(b, self.n_head)
            head = (self.head_k[:, :, a:z], self.head_v[:, :, a:z])
        b0 = self.body_start
        if self.keys is not None and self.values is not None and max(a, b0) < b:
            lo, hi = max(a, b0) - b0, b - b0
            body = (_slice(self.keys, lo, hi), _slice(self.values, lo, hi))
        return head, body

    def drop_before(self, position: int) -> None:
        """Free committed tokens before ``position`` (sliding layers past their window)."""
        cut = min(position, self.committed_end)
        b0 = self.body_start
        if cut <= self.start or cut < b0:
            return  # nothing to free, or only part of the (few) head tokens
        w = self._work
        if w is not None and w.start < cut < w.end:  # the working copy keeps its window too
            a, b = cut - w.start, w.end - w.start
            w.k, w.v, w.start = mx.contiguous(w.k[:, :, a:b]), mx.contiguous(w.v[:, :, a:b]), cut
        elif w is not None and w.start < cut:
            self._work = None
        self.head_k = self.head_v = None
        if self.keys is not None and self.values is not None:
            n = self.committed_end - b0
            self.keys, self.values = _slice(self.keys, cut - b0, n), _slice(self.values, cut - b0, n)
        self.start = cut

    def trim_to(self, n_tokens: int) -> None:
        """Keep positions < ``n_tokens`` (committed tokens only; ``start <= n_tokens``)."""
        if self._n_pending:
            raise RuntimeError("trim_to with pending tokens: commit first (this is a bug)")
        w = self._work
        if w is not None and w.start <= n_tokens:
            w.end = min(w.end, n_tokens)  # rows past ``end`` are free space for appends
        else:
            self._work = None
        if n_tokens < self.start:
            raise RuntimeError("cannot trim below the first token in memory; rebuild from blocks")
        b0 = self.body_start
        if n_tokens <= b0:
            self.keys = self.values = None
            if self.head_k is not None and self.head_v is not None:
                self.head_k, self.head_v = self.head_k[:, :, :n_tokens], self.head_v[:, :, :n_tokens]
                if n_tokens == 0:
                    self.head_k = self.head_v = None
        elif self.keys is not None and self.values is not None:
            keep = n_tokens - b0
            self.keys, self.values = _slice(self.keys, 0, keep), _slice(self.values, 0, keep)
        self.offset = n_tokens

    def load(
        self,
        start: int,
        head: tuple[mx.array, mx.array] | None,
        keys: Parts | None,
        values: Parts | None,
    ) -> None:
        """Set committed contents: ``head`` (only with ``start == 0``) then the body, in
        stored form, from absolute position ``start``."""
        if head is not None and start != 0:
            raise ValueError("head tokens are positions 0.. and need start == 0")
        self.start = start
        self.head_k, self.head_v = head if head is not None else (None, None)
        self.keys, self.values = keys, values
        self.offset = self.body_start + (0 if keys is None else keys[0].shape[2])
        self.set_pending(None, None)
        self._work = None
        self._fetched = None


def make_layer_caches(
    spec: ModelCacheSpec, quant: KVQuant, prefill_rotated: bool = False
) -> list[LayerCache]:
    """One agent's empty layer caches (``prefill_rotated``: see ``LayerCache``)."""
    dtype = getattr(mx, spec.dtype)
    layers = [LayerCache(s, quant, dtype) for s in spec.layers]
    for layer in layers:
        layer.prefill_rotated = prefill_rotated
    return layers


class BatchLayerCache:
    """One layer's caches of several agents, stepped together: the model runs one batched
    forward pass (every projection and MLP multiplies a (B, L, D) batch: decode reads the
    weights once for all agents), each agent at its own position (RoPE takes a vector of
    offsets). Attention:

    - full-attention layers: the agents' working copies merged into one left-padded buffer
      (built when the batch forms, appended in place for all agents at once, handed back
      to each agent when the batch changes), one attention call with a padding mask;
    - sliding-window layers: each agent over its own cache (windows slide apart).

    Either way each agent attends to exactly its own keys, as in a step alone.
    """

    def __init__(self, caches: list[LayerCache], offsets: mx.array | None = None) -> None:
        self.caches = caches
        # Every layer's RoPE reads the agents' positions before the step (shared array).
        self.offset = offsets if offsets is not None else mx.array([c.offset for c in caches])
        self._merged: _Merged | None = None
        self._fetched: tuple[mx.array, mx.array] | None = None
        self._mergeable = len(caches) > 1 and all(c.spec.window is None for c in caches)

    def step(self, offsets: mx.array) -> BatchLayerCache:
        """The same batch, one step later (its merged buffer kept)."""
        self.offset = offsets
        return self

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append each agent's new keys and values; return every agent's visible ones,
        left-padded to one length (``make_mask`` marks the padding)."""
        m = self._merge()
        if m is not None:
            # One write for all agents; each one's new tokens are split off its rows of the
            # buffer only when the batch dissolves (for its commit).
            m.append(keys, values)
            for cache in self.caches:
                cache.offset += keys.shape[2]
            self._fetched = (m.k[:, :, : m.end], m.v[:, :, : m.end])
            return self._fetched
        n = len(self.caches)
        fetched = [
            c.update_and_fetch(k, v)
            for c, k, v in zip(self.caches, mx.split(keys, n), mx.split(values, n), strict=True)
        ]
        # Lazy: where ``attend`` runs instead (adapted model) the padded copy is never built.
        width = max(k.shape[2] for k, _ in fetched)
        self._fetched = tuple(
            mx.concatenate([_left_pad(pair[j], width) for pair in fetched], axis=0) for j in (0, 1)
        )  # type: ignore[assignment]
        return self._fetched

    def fetched(self, keys: Any, values: Any) -> bool:
        """Whether ``keys`` / ``values`` are what ``update_and_fetch`` just returned."""
        f = self._fetched
        return f is not None and keys is f[0] and values is f[1]

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        """(B, 1, N, keys) mask over what ``update_and_fetch`` will return: each agent's own
        positions (causal, its window), never another agent's padding."""
        m = self._merge()
        if m is not None:
            return m.valid[:, None, None, : m.end + N]
        masks = []
        for c in self.caches:
            lo = c._first_visible(c.offset)
            masks.append(positional_mask(c.offset, N, lo, c.spec.window, True))
        width = max(mask.shape[-1] for mask in masks)
        return mx.stack([_left_pad(mask, width, False) for mask in masks])[:, None]

    def _merge(self) -> _Merged | None:
        """The merged buffer of full-attention layers (built at the batch's first step)."""
        if self._mergeable and self._merged is None:
            self._merged = _Merged.of(self.caches, self.caches[0].dtype)
        return self._merged

    def attend(self, queries: mx.array, scale: float, sinks: mx.array | None = None) -> mx.array:
        m = self._merged
        if m is not None:
            mask = m.valid[:, None, None, : m.end]
            return cpu_attention(queries, m.k[:, :, : m.end], m.v[:, :, : m.end], scale, mask, sinks)
        parts = mx.split(queries, len(self.caches))
        return mx.concatenate(
            [c.attend(q, scale, sinks) for c, q in zip(self.caches, parts, strict=True)], axis=0
        )

    def dissolve(self) -> None:
        """Hand each agent still running its rows of the merged buffer back (its own
        working copy), so that it can go on alone or join another batch."""
        m, self._merged = self._merged, None
        if m is None:
            return
        new = m.end - m.base  # the tokens this batch added: each agent's newest pending ones
        for i, cache in enumerate(self.caches):
            k, v = m.k[i : i + 1, :, m.pads[i] : m.end], m.v[i : i + 1, :, m.pads[i] : m.end]
            if new:
                cache.offset -= new
                cache.push_pending(k[:, :, -new:], v[:, :, -new:])
            cache._work = _Working(k, v, cache.start, cache.offset)
        self._fetched = None

    @property
    def state(self) -> list[Any]:
        return [c.state for c in self.caches]


@dataclass(slots=True)
class _Merged:
    """Several agents' visible K/V, right-aligned in one buffer (agent i's positions in
    columns ``[pads[i], end)``); ``valid`` marks the columns each agent may attend to."""

    k: mx.array
    v: mx.array
    pads: list[int]
    end: int
    valid: mx.array
    base: int  # ``end`` when built: the columns from here on are the batch's new tokens

    @classmethod
    def of(cls, caches: list[LayerCache], dtype: mx.Dtype) -> _Merged:
        works = [c._visible(c.start, dtype, rotated=False)[:2] for c in caches]
        for c in caches:
            c._work = None  # from now on the merged buffer holds it
        end = max(k.shape[2] for k, _ in works)
        cap = end + WORK_STEP
        pads = [end - k.shape[2] for k, _ in works]

        def merged(i: int) -> mx.array:
            return mx.concatenate(
                [
                    mx.pad(w[i], [(0, 0), (0, 0), (p, cap - end), (0, 0)])
                    for w, p in zip(works, pads, strict=True)
                ],
                axis=0,
            )

        valid = mx.arange(cap)[None, :] >= mx.array(pads)[:, None]
        return cls(merged(0), merged(1), pads, end, valid, end)

    def append(self, keys: mx.array, values: mx.array) -> None:
        n = keys.shape[2]
        if self.end + n > self.k.shape[2]:
            extra = -(-(self.end + n - self.k.shape[2]) // WORK_STEP) * WORK_STEP
            grow = [(0, 0), (0, 0), (0, extra), (0, 0)]
            self.k, self.v = mx.pad(self.k, grow), mx.pad(self.v, grow)
            self.valid = mx.pad(self.valid, [(0, 0), (0, extra)], constant_values=True)
        self.k[:, :, self.end : self.end + n] = keys.astype(self.k.dtype)
        self.v[:, :, self.end : self.end + n] = values.astype(self.v.dtype)
        self.end += n


def _left_pad(x: mx.array, width: int, value: Any = 0) -> mx.array:
    """``x`` padded on the left of its key axis (the last but one for K/V, the last for a
    mask) to ``width``."""
    axis = x.ndim - 1 if x.dtype == mx.bool_ else 2
    pad = [(0, 0)] * x.ndim
    pad[axis] = (width - x.shape[axis], 0)
    return mx.pad(x, pad, constant_values=value) if width > x.shape[axis] else x


def batch_layer_caches(per_agent: list[list[LayerCache]]) -> list[BatchLayerCache]:
    """Layer-major view of several agents' layer caches, for batched forward passes (keep
    it for the next steps of the same agents: ``step``; ``dissolve`` it when they change)."""
    offsets = mx.array([layers[0].offset for layers in per_agent])
    return [BatchLayerCache(list(layer), offsets) for layer in zip(*per_agent, strict=True)]
