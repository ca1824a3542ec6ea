"""How keys and values are stored: codecs (float16, or affine 2-8-bit groups, optionally
after a fixed Hadamard rotation of the head dimension), the named KV formats, and the
rotation itself (derived from a hash, pinned by a golden test: stored caches depend on it).
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, replace
from functools import partial

import numpy as np

from ..ops.fast_ops import Kernel
from ..ops.runtime import mx

#: Scales and biases are stored (on disk and in memory) at 16 bits: 0.281x FP16 bytes at
#: 4 bits / group 64, instead of 0.3125x with float32 scales.
SCALE_DTYPE = mx.float16
#: Keys and values at 16 bits ("FP16 mode"): float16.
HALF_DTYPE = mx.float16

#: The smallest group mlx quantizes in (affine; 16 is refused): a head width no group tiles
#: (80) is stored padded with zero channels up to a multiple of it (``TensorCodec.for_width``).
MIN_GROUP = 32

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
    fixed rotation of the head dimension (``rotate``). ``width``: set where the heads are
    ``width`` wide and no group tiles them (``for_width``): they are stored padded with zero
    channels to whole groups and cut back to ``width`` when decoded."""

    bits: int | None = 4
    group_size: int = 64
    rotate: bool = False
    width: int | None = None

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

    def for_width(self, dim: int) -> TensorCodec:
        """This codec for ``dim``-wide heads, so that every supported head width takes every
        format: the largest of its group size, 64 and 32 that tiles ``dim`` (96-wide heads of
        Phi-3: groups of 32); where none does (80), groups of 32 over the heads padded with
        zero channels (``width``). The rotation stays where ``dim`` has a power-of-two block
        of at least 16 (``rotation``) and is dropped where it has none (72: blocks of 8).

        Stored caches depend on this choice (the group size and padding are in the block
        tensors' shapes): it is a function of ``dim`` alone, pinned by a golden test."""
        if self.bits is None:
            return self
        rotate = self.rotate and (dim & -dim) >= 16
        for group in (self.group_size, 64, MIN_GROUP):
            if group <= self.group_size and dim % group == 0:
                return replace(self, group_size=group, rotate=rotate)
        return replace(self, group_size=MIN_GROUP, rotate=rotate, width=dim)

    def row_bytes(self, dim: int) -> int:
        """Bytes one token of one ``dim``-wide head takes stored in this codec (as fitted by
        ``for_width``): the packed values and their float16 scales and biases."""
        if self.bits is None:
            return 2 * dim
        stored = dim + -dim % self.group_size
        return stored * self.bits // 8 + 2 * SCALE_DTYPE.size * (stored // self.group_size)

    @property
    def padded(self) -> bool:
        """Whether stored heads carry zero channels past ``width`` (see ``for_width``)."""
        return self.width is not None

    def encode(self, x: mx.array) -> tuple[mx.array, ...]:
        """Full precision (B, H, N, D) -> stored form (tuple of arrays, last axis packed)."""
        if self.rotate:
            x = x.astype(mx.float32) @ rotation(x.shape[-1])
        if self.bits is None:
            return (x.astype(HALF_DTYPE),)
        if self.width is not None:
            pad = -self.width % self.group_size
            x = mx.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
        q, scales, biases = mx.quantize(x, group_size=self.group_size, bits=self.bits)
        return q, scales.astype(SCALE_DTYPE), biases.astype(SCALE_DTYPE)

    def decode(self, parts: tuple[mx.array, ...], dtype: mx.Dtype) -> mx.array:
        """Stored form -> full precision, still rotated if ``rotate`` (per layer and call)."""
        if self.bits is None:
            return parts[0].astype(dtype)
        q, scales, biases = parts
        if mx.default_device() == mx.cpu:
            x = unpack_affine(q, scales.astype(dtype), biases.astype(dtype), self.bits, self.group_size)
        else:
            x = mx.dequantize(
                q, scales.astype(dtype), biases.astype(dtype), group_size=self.group_size, bits=self.bits
            )
        return x if self.width is None else x[..., : self.width]


def _affine_values(
    words: mx.array, shifts: mx.array, scales: mx.array, biases: mx.array, bits: int
) -> mx.array:
    """Words -> values, broadcast against ``shifts`` (one per value of a word): one loop.
    Everything arrives broadcast-ready and at the output's dtype: inside the fused loop an
    ``expand_dims`` costs 1.7x and a float16 -> float32 conversion 3x (no F16C in the JIT's
    baseline x86-64 code)."""
    return ((words >> shifts) & ((1 << bits) - 1)).astype(scales.dtype) * scales + biases


def _run_values(*parts: mx.array, bits: int) -> mx.array:
    """Byte runs (3 bytes for 3 and 6 bits, 5 for 5 bits) -> values, the run's word
    assembled in the same loop: ``parts`` are the run's bytes, then shifts, scales, biases."""
    *run, shifts, scales, biases = parts
    words = run[0].astype(shifts.dtype)
    for j, byte in enumerate(run[1:], start=1):
        words = words | (byte.astype(shifts.dtype) << (8 * j))
    return _affine_values(words, shifts, scales, biases, bits)


_word_kernels = {bits: Kernel(partial(_affine_values, bits=bits)) for bits in (2, 4, 8)}
_run_kernels = {bits: Kernel(partial(_run_values, bits=bits)) for bits in (3, 5, 6)}


def unpack_affine(q: mx.array, scales: mx.array, biases: mx.array, bits: int, group_size: int) -> mx.array:
    """``mx.dequantize`` on CPU, bit for bit, as one fused loop per call (``Kernel``).

    mlx's CPU kernel unpacks one value at a time (6-bit keys of a 2.3K-token layer: 5.2 ms),
    and shifts and masks as separate ops write every intermediate to memory: a warm restore
    decodes every layer's stored body, and at 8K tokens of SmolLM2 (30 layers, 6-bit keys,
    4-bit values) that took 0.26 s of its 0.7.

    mlx packs values as a little-endian bit stream: ``lcm(bits, 8)`` bits hold a whole
    number of values (3 and 6 bits: 3 bytes; 5 bits: 5 bytes; 2, 4, 8 bits: any word).
    """
    lead, groups = q.shape[:-1], scales.shape[-1]
    run_bytes = 4 if 32 % bits == 0 else int(np.lcm(bits, 8)) // 8
    word_type = mx.uint32 if run_bytes <= 4 else mx.uint64
    shifts = mx.arange(0, run_bytes * 8, bits, dtype=word_type)
    s, b = scales[..., None, None], biases[..., None, None]
    if run_bytes == 4:
        out = _word_kernels[bits](q.reshape(*lead, groups, -1)[..., None], shifts, s, b)
    else:
        by = mx.view(q, mx.uint8).reshape(*lead, groups, -1, run_bytes)
        out = _run_kernels[bits](*(by[..., j, None] for j in range(run_bytes)), shifts, s, b)
    return out.reshape(*lead, -1)


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

    def for_dims(self, k_dim: int, v_dim: int) -> KVQuant:
        """This format for one layer's key and value widths (``TensorCodec.for_width``): what
        its ``LayerCache`` stores in. ``label`` stays the format's own."""
        return replace(self, keys=self.keys.for_width(k_dim), values=self.values.for_width(v_dim))


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


def preset_name(quant: KVQuant) -> str | None:
    """The ``KV_PRESETS`` name of ``quant`` (None for a format of one's own)."""
    return next((name for name, q in KV_PRESETS.items() if q == quant), None)


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
