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
#: The working copy of a running request's visible K/V grows by this many positions.
WORK_STEP = 256


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

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[LayerCache, LayerCache]:
        if self._work is not None and self._work.end == self.offset:
            self._append_work(keys, values)
        self.push_pending(keys, values)
        # mlx-lm passes these on to its attention function; ours (installed by
        # install_attention_hook) recognises the cache and calls ``attend``.
        return self, self

    def push_pending(self, keys: mx.array, values: mx.array) -> None:
        """Add this request's new tokens (without touching the working copy)."""
        self._pending.append((keys, values))
        self._n_pending += keys.shape[2]
        self.offset += keys.shape[2]

    def make_mask(self, *args: Any, **kwargs: Any) -> None:
        return None  # masks are built in ``attend``, from positions and the layer's window

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

    def attend(self, queries: mx.array, scale: float) -> mx.array:
        """Attention of ``queries`` (the last L positions) over every visible key.

        Over a full-precision working copy of the visible keys and values (``_visible``),
        one BLAS attention: the 4-bit kernels are several times slower on CPU, and a decode
        step over stored segments took ~20 small ops per layer where this takes a few. With
        a rotated codec a prefill works in the rotated space (queries, head and this
        request's keys / values are rotated: few rows), so the first token never waits for
        the stored body to be rotated back; that happens once, at the first decode step.
        """
        L = queries.shape[2]
        window = self.spec.window
        first_q = self.offset - L
        # Keys a sliding-window layer can no longer see are not even read.
        lo = self.start if window is None else max(self.start, first_q - window + 1)
        k, v, krot, vrot = self._visible(lo, queries.dtype, decode=L == 1)
        q = queries @ rotation(queries.shape[-1]) if krot else queries
        out = _sdpa(q, k, v, scale, self._mask(first_q, L, k.shape[2]))
        return out @ rotation(out.shape[-1]).T if vrot else out

    def _visible(self, lo: int, dtype: mx.Dtype, decode: bool) -> tuple[mx.array, mx.array, bool, bool]:
        """Positions ``[lo, offset)`` at full precision, and whether K and V are in their
        codec's rotated space. Built once per request (the stored body unpacked), then kept
        in step by ``update_and_fetch`` until ``commit``: a chunked prefill or a decode step
        does not unpack the body again. A decode step wants it unrotated (no rotation per
        step): the first one rotates it back."""
        w = self._work
        if w is None or w.start > lo or w.end != self.offset:
            krot, vrot = self.quant.keys.rotate and not decode, self.quant.values.rotate and not decode
            k, v = self._decoded(lo, dtype, krot, vrot)
            w = self._work = _Working(k, v, lo, self.offset, krot, vrot)
        elif decode and (w.krot or w.vrot):
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
            if isinstance(cache, (LayerCache, BatchLayerCache)):
                return cache.attend(queries, scale)
            return _previous(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

        hooked._agent_memory_hook = True  # type: ignore[attr-defined]
        module.scaled_dot_product_attention = hooked


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
        self._mergeable = len(caches) > 1 and all(c.spec.window is None for c in caches)

    def step(self, offsets: mx.array) -> BatchLayerCache:
        """The same batch, one step later (its merged buffer kept)."""
        self.offset = offsets
        return self

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self._mergeable and self._merged is None:
            self._merged = _Merged.of(self.caches, keys.dtype)
        if self._merged is not None:
            # One write for all agents; each one's new tokens are split off its rows of the
            # buffer only when the batch dissolves (for its commit).
            self._merged.append(keys, values)
            for cache in self.caches:
                cache.offset += keys.shape[2]
            return keys, values
        n = len(self.caches)
        for cache, k, v in zip(self.caches, mx.split(keys, n), mx.split(values, n), strict=True):
            cache.update_and_fetch(k, v)
        return keys, values  # unused: attention is ``attend``

    def attend(self, queries: mx.array, scale: float) -> mx.array:
        m = self._merged
        if m is not None:
            mask = m.valid[:, None, None, : m.end]
            return _sdpa(queries, m.k[:, :, : m.end], m.v[:, :, : m.end], scale, mask)
        parts = mx.split(queries, len(self.caches))
        return mx.concatenate([c.attend(q, scale) for c, q in zip(self.caches, parts, strict=True)], axis=0)

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

    def make_mask(self, *args: Any, **kwargs: Any) -> None:
        return None  # masks are built in ``attend``

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
        works = [c._visible(c.start, dtype, decode=True)[:2] for c in caches]
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


def batch_layer_caches(per_agent: list[list[LayerCache]]) -> list[BatchLayerCache]:
    """Layer-major view of several agents' layer caches, for batched forward passes (keep
    it for the next steps of the same agents: ``step``; ``dissolve`` it when they change)."""
    offsets = mx.array([layers[0].offset for layers in per_agent])
    return [BatchLayerCache(list(layer), offsets) for layer in zip(*per_agent, strict=True)]
