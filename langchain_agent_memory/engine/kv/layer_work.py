"""The working-copy half of ``LayerCache`` (it inherits ``WorkingCopy``): a running request's
visible keys and values at full precision, decoded from the stored form once when the
request starts and appended in place, within the budget the engine keeps for them."""

from __future__ import annotations

import contextlib

from ..ops.runtime import mx, side_streams
from .buffers import Working, grown_rows, in_space, with_room
from .codecs import KVQuant
from .stored import Parts


class WorkingCopy:
    """The working copy of one layer (its attributes are the layer's)."""

    _work: Working | None
    offset: int
    quant: KVQuant
    reserved_rows: int
    keys: Parts | None

    def _visible(self, lo: int, dtype: mx.Dtype, rotated: bool) -> tuple[mx.array, mx.array, bool, bool]:
        """Positions ``[lo, offset)`` at full precision, and whether K and V are in their
        codec's rotated space. Built once per request (the stored body unpacked), then kept
        in step by ``update_and_fetch`` until ``commit``: a chunked prefill or a decode step
        does not unpack the body again. ``rotated``: a prefill may stay in the rotated space;
        otherwise (a decode step) the copy is moved out of it, once."""
        w = self._work
        if w is None or w.start > lo or w.end != self.offset:
            # The rotated space only where a stored body is in it: a copy of full-precision
            # tokens only (a fan-out's fork) would be rotated for its tail, then back.
            rotated = rotated and self.keys is not None and max(lo, self.body_start) < self.committed_end
            krot, vrot = self.quant.keys.rotate and rotated, self.quant.values.rotate and rotated
            k, v = self._decoded(lo, dtype, krot, vrot, room=True)
            w = self._work = Working(k, v, lo, self.offset, krot, vrot)
        elif not rotated and (w.krot or w.vrot):
            # The whole buffer, its spare rows too (zeros, or rows past ``end`` that appends
            # overwrite before any query reads them): cut to the used rows, the next append
            # copied all of it again to make room (every layer of every member of a fan-out).
            w.k, w.v = in_space(w.k, w.krot, False), in_space(w.v, w.vrot, False)
            w.krot = w.vrot = False
        a, b = lo - w.start, w.end - w.start
        return w.k[:, :, a:b], w.v[:, :, a:b], w.krot, w.vrot

    def _decoded(
        self, lo: int, dtype: mx.Dtype, krot: bool, vrot: bool, room: bool = False
    ) -> tuple[mx.array, mx.array]:
        """Positions ``[lo, offset)`` as held, at full precision (in the rotated space
        where ``krot`` / ``vrot``); with ``room``, followed by spare positions (``grown_rows``).

        The largest segment (the stored body) is decoded straight into a buffer of the whole
        size: its packed parts are padded (zeros decode to zeros) and the other segments are
        written into it in place. Joining decoded segments instead wrote every value twice:
        at 8K tokens of SmolLM2, 470 ms of a warm restore's 650 against 355 for the decode.
        With ``room`` (a working copy being built: the first chunk of a warm request waits
        for it) keys and values are decoded on two streams of their own, beside the model."""
        segments = self._segments(lo)
        n = self.offset - lo
        rows = self._work_rows(n) if room and len(segments) > 1 else n
        big = max(range(len(segments)), key=lambda i: segments[i][0][0].shape[2])
        streams = side_streams() if room else (None, None)
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

    def _work_rows(self, needed: int) -> int:
        """Rows of a working-copy buffer for ``needed`` positions: ``grown_rows``, or the
        reserved size where that holds them with at most half of it spare (its buffer then
        comes from the engine's touched reserve; ``reserve``)."""
        rows, reserved = grown_rows(needed), self.reserved_rows
        return reserved if rows <= reserved <= 2 * rows else rows

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
        if used + n > w.k.shape[2]:  # grow with room: appends are then in place
            # A sliding layer lets go of the rows no query from here on sees: its copy stays
            # about a window and a chunk long, not the whole context (a Gemma 3 4B shape's
            # 32K-token cold turn on the H200: peak memory 18.4 -> 14.5 GB), and what is
            # copied to make room is that window, not every row so far.
            drop = self._first_visible(self.offset) - w.start
            if drop > 0:
                w.k, w.v = w.k[:, :, drop:used], w.v[:, :, drop:used]
                w.start, used = w.start + drop, used - drop
            rows = self._work_rows(used + n)
            w.k, w.v = with_room(w.k, used, rows), with_room(w.v, used, rows)
        w.k[:, :, used : used + n] = in_space(keys.astype(w.k.dtype), False, w.krot)
        w.v[:, :, used : used + n] = in_space(values.astype(w.v.dtype), False, w.vrot)
        w.end += n
