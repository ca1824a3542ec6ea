"""Buffers of a layer's keys and values that grow in place: room for appends (``grown_rows``,
``with_room``), views of stored parts (``slice_parts``), a batch member's rows copied out
and built at once (``own_copy``, ``evaluated``), the move between the model's space
and the codec's rotated one (``in_space``), a request's full-precision working copy
(``Working``) and its tokens as appended (``Pending``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..ops.runtime import mx
from .codecs import rotation
from .stored import Parts

#: The working copy of a running request's visible K/V grows by this many positions.
WORK_STEP = 256


def slice_parts(parts: Parts, start: int, stop: int) -> Parts:
    return tuple(p[:, :, start:stop] for p in parts)


def grown_rows(needed: int, share: int = 8) -> int:
    """Rows to allocate when a buffer must hold ``needed``: a ``share``-th more (an eighth),
    in whole ``WORK_STEP``s. Appends then update in place and what is held is copied once per
    eighth of growth; with a fixed step a 64K-token agent of an 8B model copied its 8.6 GB
    working copy on the first append of every turn (0.36 s of a hot turn's 0.55 on the
    H200), and a chunked prefill copied it once per chunk."""
    want = needed + max(WORK_STEP, needed // share)
    return -(-want // WORK_STEP) * WORK_STEP


def spare_rows(like: mx.array, rows: int) -> mx.array:
    """``rows`` empty positions (axis 2) shaped and typed as ``like``."""
    return mx.zeros((*like.shape[:2], rows, like.shape[3]), like.dtype)


def with_room(x: mx.array, used: int, rows: int) -> mx.array:
    """``x``'s first ``used`` positions (axis 2) in a new buffer of ``rows`` positions."""
    return mx.concatenate([x[:, :, :used], spare_rows(x, rows - used)], axis=2)


def own_copy(x: mx.array) -> mx.array:
    """A copy of ``x`` (a view of a batch's rows) in a buffer of its own: a view would keep
    the whole batch's buffer alive while any member holds one, memory no budget counts."""
    return mx.contiguous(x)


def evaluated(*trees: Any) -> None:
    """Build now what a batch change made (one layer at a time): what it was made from is
    then free at once, rather than held beside it until the whole step's graph runs (a
    batch of agents whose K/V fill most of the device's memory has no room for two)."""
    mx.eval([t for t in trees if t is not None])


def in_space(x: mx.array, rotated: bool, want_rotated: bool) -> mx.array:
    """``x`` (rotated or not) moved into the rotated space or out of it, as wanted; in
    ``x``'s dtype. NOTE: the float32 rotation would promote a bf16 / fp16 ``x`` to float32:
    a working copy built from the stored form and one whose rows were replaced by it must
    hold the same values in the same dtype (hot == warm), and float32 copies of a 16-bit
    model's keys double their memory."""
    if rotated == want_rotated:
        return x
    r = rotation(x.shape[-1])
    out = x @ r if want_rotated else x @ r.T
    return out if out.dtype == x.dtype else out.astype(x.dtype)


@dataclass(slots=True)
class Working:
    """A running request's visible K/V at full precision (rows ``[start, end)`` valid)."""

    k: mx.array
    v: mx.array
    start: int
    end: int
    krot: bool = False  # K rows in the keys codec's rotated space (during a prefill)
    vrot: bool = False
    #: Rows ``[start, start + decoded_rows)`` are the decode of ``decoded_from`` (a
    #: ``DecodedPrefix``): every copy with the same two holds the same values there, so a
    #: decode batch of them reads those rows once for all (``BatchLayerCache.attend``).
    decoded_from: object | None = None
    decoded_rows: int = 0

    def keep_decoded(self, end: int) -> None:
        """Rows from ``end`` on (relative to ``start``) are no longer the prefix decode's."""
        self.decoded_rows = max(0, min(self.decoded_rows, end))
        if not self.decoded_rows:
            self.decoded_from = None


class Pending:
    """A running request's tokens at full precision, as appended (``push``); joined when read
    (``joined``) into the first entry, a buffer with room (its first ``rows`` valid): a decode
    step that reads them (``serve_stored``) then writes one row, not a copy of all of them."""

    __slots__ = ("chunks", "n", "rows")

    def __init__(self) -> None:
        self.chunks: list[tuple[mx.array, mx.array]] = []
        self.rows = 0  # valid rows of ``chunks[0]``
        self.n = 0  # tokens held

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for pair in self.chunks for a in pair)

    def push(self, keys: mx.array, values: mx.array) -> None:
        if not self.chunks:
            self.rows = keys.shape[2]
        self.chunks.append((keys, values))
        self.n += keys.shape[2]

    def set(self, keys: mx.array | None, values: mx.array | None) -> None:
        """Hold ``keys`` / ``values`` only (none where either is None)."""
        self.chunks = [] if keys is None or values is None else [(keys, values)]
        self.n = self.rows = 0 if keys is None else keys.shape[2]

    def keep(self, n: int) -> None:
        """Hold the first ``n`` tokens only (the buffer stays: its later rows are room)."""
        self.joined()
        if n:
            self.n = self.rows = n
        else:
            self.set(None, None)

    def joined(self) -> tuple[mx.array | None, mx.array | None]:
        """The tokens held, as one array each of keys and values (views of the buffer)."""
        if not self.chunks:
            return None, None
        n = self.n
        if len(self.chunks) > 1:
            (k, v), extra = self.chunks[0], self.chunks[1:]
            used = self.rows
            if n > k.shape[2]:  # grow with room: the next appends are written in place
                rows = grown_rows(n)
                k, v = with_room(k, used, rows), with_room(v, used, rows)
            for nk, nv in extra:
                m = nk.shape[2]
                k[:, :, used : used + m] = nk.astype(k.dtype)
                v[:, :, used : used + m] = nv.astype(v.dtype)
                used += m
            self.chunks, self.rows = [(k, v)], n
        k, v = self.chunks[0]
        return (k, v) if k.shape[2] == n else (k[:, :, :n], v[:, :, :n])
