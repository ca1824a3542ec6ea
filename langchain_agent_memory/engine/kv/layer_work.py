"""A layer's working copy (``WorkingCopy``, held by ``LayerCache``): a running request's
visible keys and values at full precision, decoded from the stored form once when the
request starts (``decode_segments``) and appended in place, within the budget the engine
keeps for them."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

from ..ops.runtime import mx, side_streams
from .buffers import Working, grown_rows, in_space, with_room
from .stored import Segment

#: A layer's held tokens from an absolute position on, oldest first (``LayerCache._segments``).
Segments = Callable[[int], list[Segment]]


class DecodedPrefix:
    """One layer's stored prefix decoded once for every request that starts from the same
    stored blocks (the layers ``restore`` builds from one chain's first tokens): a fan-out's
    siblings over one stored system prompt each needed a working copy of it, and each decoded
    its own (8 Sends over 1K tokens of SmolLM2: 0.18 s of prefill each, most of it this).

    The decoded rows are kept only while a second request holds the same blocks (``users``:
    the working copies attached, until their commit): a lone request keeps no second copy.
    Each user's own rows are then written into a copy of them (mlx copies a buffer that
    another array still reads), so what it attends to is exactly what it would have decoded."""

    __slots__ = ("__weakref__", "_k", "_key", "_v", "users")

    def __init__(self) -> None:
        self.users: weakref.WeakSet[WorkingCopy] = weakref.WeakSet()
        self._k: mx.array | None = None
        self._v: mx.array | None = None
        self._key: tuple[Any, ...] | None = None

    def get(self, key: tuple[Any, ...]) -> tuple[mx.array, mx.array] | None:
        if self._k is None or self._v is None or key != self._key:
            return None
        return self._k, self._v

    def put(self, key: tuple[Any, ...], k: mx.array, v: mx.array) -> None:
        if len(self.users) > 1:  # another request may start from it
            self._k, self._v, self._key = k, v, key

    def detach(self, user: WorkingCopy) -> None:
        self.users.discard(user)
        if not self.users:
            self._k = self._v = self._key = None


class WorkingCopy:
    """The working copy of one layer (``buf``: rows ``[buf.start, buf.end)``, or None where
    none is kept), the rows the engine reserved for its buffers (``reserved_rows``) and the
    decode of its stored prefix it shares with other requests (``shared``; see
    ``DecodedPrefix``)."""

    __slots__ = ("__weakref__", "buf", "reserved_rows", "shared")

    def __init__(self, reserved_rows: int = 0) -> None:
        self.reserved_rows = reserved_rows
        self.buf: Working | None = None
        self.shared: DecodedPrefix | None = None

    def share(self, decoded: DecodedPrefix) -> None:
        """Build the stored part of this copy through ``decoded`` (until ``unshare``)."""
        self.unshare()
        self.shared = decoded
        decoded.users.add(self)

    def unshare(self) -> None:
        """The layer's stored part changes (a commit): its decode is its own again."""
        if self.shared is not None:
            self.shared.detach(self)
            self.shared = None

    @property
    def nbytes(self) -> int:
        w = self.buf
        return 0 if w is None else int(w.k.nbytes + w.v.nbytes)

    def split_rows(self) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """The copy's prefix rows (``Working.decoded_rows``) and its rows after them, as
        keys and values each (views)."""
        w = self.buf
        assert w is not None and w.decoded_rows
        n, used = w.decoded_rows, w.end - w.start
        return w.k[:, :, :n], w.v[:, :, :n], w.k[:, :, n:used], w.v[:, :, n:used]

    def rows(self, needed: int) -> int:
        """Rows of a working-copy buffer for ``needed`` positions: ``grown_rows``, or the
        reserved size where that holds them with at most half of it spare (its buffer then
        comes from the engine's touched reserve; ``reserve``)."""
        rows, reserved = grown_rows(needed), self.reserved_rows
        return reserved if rows <= reserved <= 2 * rows else rows

    def visible(
        self, lo: int, end: int, dtype: mx.Dtype, rotated: bool, segments: Segments, own: int = 0
    ) -> tuple[mx.array, mx.array, bool, bool]:
        """Positions ``[lo, end)`` at full precision (``end``: the layer's offset), and
        whether K and V are in their codec's rotated space. Built once per request from the
        layer's ``segments``, then kept in step by ``append`` until the commit: a chunked
        prefill or a decode step does not unpack the body again. ``rotated``: a prefill may
        stay in the rotated space; otherwise (a decode step) the copy is moved out of it, once.
        ``own``: the layer's last segment is this request's tokens (not stored) where > 0."""
        w = self.buf
        if w is None or w.start > lo or w.end != end:
            held = segments(lo)
            # The rotated space only where a stored body is in it (the head and the pending
            # tokens are never rotated): a copy of full-precision tokens only (a fan-out's
            # fork) would be rotated for its tail, then back.
            krot = rotated and any(seg[2].rotate for seg in held)
            vrot = rotated and any(seg[3].rotate for seg in held)
            rows = self.rows(end - lo) if len(held) > 1 else end - lo
            k, v, n = self._decode(held, lo, rows, dtype, krot, vrot, own)
            w = self.buf = Working(k, v, lo, end, krot, vrot, self.shared if n else None, n)
        elif not rotated and (w.krot or w.vrot):
            # The whole buffer, its spare rows too (zeros, or rows past ``end`` that appends
            # overwrite before any query reads them): cut to the used rows, the next append
            # copied all of it again to make room (every layer of every member of a fan-out).
            w.k, w.v = in_space(w.k, w.krot, False), in_space(w.v, w.vrot, False)
            w.krot = w.vrot = False
        a, b = lo - w.start, w.end - w.start
        return w.k[:, :, a:b], w.v[:, :, a:b], w.krot, w.vrot

    def _decode(
        self, held: list[Segment], lo: int, rows: int, dtype: mx.Dtype, krot: bool, vrot: bool, own: int
    ) -> tuple[mx.array, mx.array, int]:
        """``held`` decoded into buffers of ``rows`` positions: the stored part through
        ``shared`` where it is set (decoded once for all its users), then the request's own
        rows written in; and how many leading rows are ``shared``'s decode (0: none). The
        first chunk of a warm request waits for it: keys and values are decoded on two
        streams of their own, beside the model."""
        streams = side_streams()
        stored = held[:-1] if own and held else held
        if self.shared is None or not stored:
            return (*decode_segments(held, rows, dtype, krot, vrot, streams), 0)
        n = sum(seg[0][0].shape[2] for seg in stored)
        key = (lo, n, dtype, krot, vrot)
        got = self.shared.get(key)
        if got is None:
            got = decode_segments(stored, rows, dtype, krot, vrot, streams)
            self.shared.put(key, *got)
        k, v = (x[:, :, :rows] if x.shape[2] >= rows else with_room(x, n, rows) for x in got)
        if stored is not held:  # a slice of its own: writing into it leaves ``shared``'s intact
            seg = held[-1]
            m = n + seg[0][0].shape[2]
            k[:, :, n:m] = in_space(seg[2].decode(seg[0], dtype), seg[2].rotate, krot)
            v[:, :, n:m] = in_space(seg[3].decode(seg[1], dtype), seg[3].rotate, vrot)
        return k, v, n

    def append(self, keys: mx.array, values: mx.array, end: int, first_visible: Callable[[int], int]) -> None:
        """Add a step's new tokens where the copy is in step with the layer (holds its
        positions up to ``end``, the offset before them); ``first_visible``: the layer's."""
        w = self.buf
        if w is None or w.end != end:
            return
        n, used = keys.shape[2], w.end - w.start
        if used + n > w.k.shape[2]:  # grow with room: appends are then in place
            # A sliding layer lets go of the rows no query from here on sees: its copy stays
            # about a window and a chunk long, not the whole context (a Gemma 3 4B shape's
            # 32K-token cold turn on the H200: peak memory 18.4 -> 14.5 GB), and what is
            # copied to make room is that window, not every row so far.
            drop = first_visible(end) - w.start
            if drop > 0:
                w.k, w.v = w.k[:, :, drop:used], w.v[:, :, drop:used]
                w.start, used = w.start + drop, used - drop
                w.keep_decoded(0)
            rows = self.rows(used + n)
            w.k, w.v = with_room(w.k, used, rows), with_room(w.v, used, rows)
        w.k[:, :, used : used + n] = in_space(keys.astype(w.k.dtype), False, w.krot)
        w.v[:, :, used : used + n] = in_space(values.astype(w.v.dtype), False, w.vrot)
        w.end += n

    def refresh(self, first: int, end: int, segments: Segments) -> None:
        """Replace rows ``[first, end)`` (those the copy still has) by what the layer's
        ``segments`` decode to (after a commit: its stored form's)."""
        w = self.buf
        assert w is not None
        lo = max(first, w.start)
        if lo >= end:
            return
        dk, dv = decode_segments(segments(lo), end - lo, w.k.dtype, w.krot, w.vrot)
        a, b = lo - w.start, end - w.start
        joined = w.decoded_rows > 0
        w.keep_decoded(a)
        w.k[:, :, a:b] = dk
        w.v[:, :, a:b] = dv
        # Not a graph holding this request's arrays until the next one; except a copy whose
        # first rows are a decode shared with other requests (a fan-out sibling's, handed back
        # by its batch as a join of that decode and its own rows: ``_Merged.hand_back``).
        # Evaluated here, each sibling of 8 built a whole copy of the common prompt (~50 MB
        # at 1K tokens of SmolLM2: 0.35 s of a 3.4 s fan-out, on the model's thread) that its
        # agent may never read; it is built where its next turn reads it (on this thread).
        if not joined:
            mx.eval(w.k, w.v)

    def unfeed(self, end: int) -> None:
        """The layer holds positions before ``end`` only: the rows past it stay as room."""
        w = self.buf
        if w is not None and w.end > end:
            w.end = end
            w.keep_decoded(end - w.start)

    def trim_to(self, n_tokens: int) -> None:
        """Keep positions < ``n_tokens`` (rows past them: room), or nothing where it starts later."""
        w = self.buf
        if w is not None and w.start <= n_tokens:
            w.end = min(w.end, n_tokens)
            w.keep_decoded(n_tokens - w.start)
        else:
            self.buf = None

    def drop_before(self, cut: int) -> None:
        """The layer frees positions before ``cut``: the copy keeps its window too."""
        w = self.buf
        if w is not None and w.start < cut < w.end:
            a, b = cut - w.start, w.end - w.start
            w.k, w.v, w.start = mx.contiguous(w.k[:, :, a:b]), mx.contiguous(w.v[:, :, a:b]), cut
            w.keep_decoded(0)
        elif w is not None and w.start < cut:
            self.buf = None


def decode_segments(
    segments: list[Segment],
    rows: int,
    dtype: mx.Dtype,
    krot: bool,
    vrot: bool,
    streams: tuple[Any, Any] = (None, None),
) -> tuple[mx.array, mx.array]:
    """``segments`` at full precision (in the rotated space where ``krot`` / ``vrot``), in
    buffers of ``rows`` positions: theirs, then spare ones.

    The largest segment (the stored body) is decoded straight into a buffer of the whole
    size: its packed parts are padded (zeros decode to zeros) and the other segments are
    written into it in place. Joining decoded segments instead wrote every value twice: at
    8K tokens of SmolLM2, 470 ms of a warm restore's 650 against 355 for the decode. Keys
    and values are decoded on ``streams`` where given."""
    big = max(range(len(segments)), key=lambda i: segments[i][0][0].shape[2])
    out = []
    for side, rotated, stream in ((0, krot, streams[0]), (1, vrot, streams[1])):
        pieces = [(seg[side], seg[2 + side]) for seg in segments]
        with mx.stream(stream) if stream is not None else contextlib.nullcontext():
            before = sum(parts[0].shape[2] for parts, _ in pieces[:big])
            parts, codec = pieces[big]
            after = rows - before - parts[0].shape[2]
            if before or after:
                parts = tuple(mx.pad(x, [(0, 0), (0, 0), (before, after), (0, 0)]) for x in parts)
            buf = in_space(codec.decode(parts, dtype), codec.rotate, rotated)
            at = 0
            for i, (parts, codec) in enumerate(pieces):
                m = parts[0].shape[2]
                if i != big:
                    buf[:, :, at : at + m] = in_space(codec.decode(parts, dtype), codec.rotate, rotated)
                at += m
        out.append(buf)
    return out[0], out[1]
