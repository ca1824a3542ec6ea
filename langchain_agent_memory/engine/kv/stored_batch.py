"""Several agents decoding together, each over its stored form, in one attention call per
layer (``BatchLayerCache`` on full-attention layers of agents served from the stored form).

Why: one agent at a time, a batch of 16 runs 16 attention calls of ~12 ops per layer and
step. Here the agents' held K/V are moved into one batch per layer, each region left-padded
to the longest member: the 16-bit head tokens, the quantized body (padding decodes to zero
and is masked), and the running requests' full-precision tokens (with room: a step writes
one column for every agent). One ``stored_attention`` with a validity mask then serves all
of them. The agents' own arrays are handed over (not copied): the batch holds each agent's
K/V once, in the stored form, and each gets views of its rows back when it leaves.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..runtime import mx
from . import stored_cuda
from .codecs import FULL, HALF_DTYPE, KVQuant
from .layer import LayerCache, grown_rows
from .stored import Parts, Segment, stored_attention


def _left(x: mx.array, width: int, room: int = 0) -> mx.array:
    """``x`` (1, heads, n, ·) zero-padded on the left of its key axis to ``width`` (then
    ``room`` more columns on the right)."""
    n = x.shape[2]
    return mx.pad(x, [(0, 0), (0, 0), (width - n, room), (0, 0)]) if width - n or room else x


@dataclass(slots=True)
class StoredBatch:
    """Members' head (``n_head`` columns), body (``n_body``) and pending tokens (``end`` of
    a buffer with room), each region right-aligned per member; ``valid`` (B, columns) marks
    what each member holds; ``held[i]``: member i's (head, body, pending) token counts."""

    quant: KVQuant
    head: tuple[mx.array, mx.array] | None
    body: tuple[Parts, Parts] | None
    pending: tuple[mx.array, mx.array]
    n_head: int
    n_body: int
    end: int
    valid: mx.array
    row_starts: mx.array  # (B, 4) int32: each member's first body, head, pending column
    held: list[tuple[int, int, int]]
    built_end: int  # ``end`` when the batch was built (member i's pending began at built_end - its count)

    @classmethod
    def of(cls, caches: list[LayerCache]) -> StoredBatch:
        """The batch of ``caches`` (their held K/V handed over to it)."""
        quant = caches[0].quant
        heads = [
            (c.head_k, c.head_v) if c.head_k is not None and c.head_v is not None else None for c in caches
        ]
        bodies = [(c.keys, c.values) if c.keys is not None and c.values is not None else None for c in caches]
        pendings = [c._joined_pending() for c in caches]
        held = [
            (
                0 if h is None else h[0].shape[2],
                0 if b is None else b[0][0].shape[2],
                0 if p[0] is None else p[0].shape[2],
            )
            for h, b, p in zip(heads, bodies, pendings, strict=True)
        ]
        n_head, n_body, n_pend = (max(x[j] for x in held) for j in range(3))
        cap = grown_rows(n_pend + 1)
        head = None
        if n_head:
            ref_head = next(h for h in heads if h is not None)
            head = tuple(
                mx.concatenate(
                    [_left(h[side] if h is not None else ref_head[side][:, :, :0], n_head) for h in heads]
                ).astype(HALF_DTYPE)
                for side in (0, 1)
            )
        body = None
        if n_body:
            ref = next(b for b in bodies if b is not None)
            body = tuple(
                tuple(
                    mx.concatenate(
                        [
                            _left(b[side][j] if b is not None else ref[side][j][:, :, :0], n_body)
                            for b in bodies
                        ]
                    )
                    for j in range(len(ref[side]))
                )
                for side in (0, 1)
            )
        empty = [next(p[side] for p in pendings if p[side] is not None)[:, :, :0] for side in (0, 1)]
        pending = tuple(
            mx.concatenate(
                [
                    _left(p[side] if p[side] is not None else empty[side], n_pend, cap - n_pend)
                    for p in pendings
                ]
            )
            for side in (0, 1)
        )
        cols = mx.arange(n_head + n_body + cap)[None]
        counts = mx.array(held)

        def region(first: int, width: int, count: mx.array) -> mx.array:
            """Each member's last ``count`` columns of the region ``[first, first + width)``."""
            return (cols >= first + width - count) & (cols < first + width)

        valid = (
            region(0, n_head, counts[:, :1])
            | region(n_head, n_body, counts[:, 1:2])
            | region(n_head + n_body, n_pend, counts[:, 2:3])
        )
        for c in caches:  # handed over: the batch holds them now
            c.head_k = c.head_v = None
            c._set_body(None, None)
            c.set_pending(None, None)
        row_starts = mx.array(
            [[n_body - b, n_head - h, n_pend - p, stored_cuda.ALL_VISIBLE] for h, b, p in held],
            dtype=mx.int32,
        )
        return cls(quant, head, body, pending, n_head, n_body, n_pend, valid, row_starts, held, n_pend)  # type: ignore[arg-type]

    def append(self, keys: mx.array, values: mx.array) -> None:
        """One step's keys and values, one column for every member."""
        n = keys.shape[2]
        pk, pv = self.pending
        if self.end + n > pk.shape[2]:
            extra = grown_rows(self.end + n) - pk.shape[2]
            grow = [(0, 0), (0, 0), (0, extra), (0, 0)]
            pk, pv = mx.pad(pk, grow), mx.pad(pv, grow)
            self.valid = mx.pad(self.valid, [(0, 0), (0, extra)], constant_values=False)
        pk[:, :, self.end : self.end + n] = keys.astype(pk.dtype)
        pv[:, :, self.end : self.end + n] = values.astype(pv.dtype)
        at = self.n_head + self.n_body + self.end
        self.valid[:, at : at + n] = True
        self.pending = (pk, pv)
        self.end += n

    def attend(self, queries: mx.array, scale: float, sinks: mx.array | None = None) -> mx.array:
        segments: list[Segment] = []
        if self.head is not None:
            segments.append(((self.head[0],), (self.head[1],), FULL, FULL))
        if self.body is not None:
            segments.append((self.body[0], self.body[1], self.quant.keys, self.quant.values))
        pk, pv = self.pending
        segments.append(((pk[:, :, : self.end],), (pv[:, :, : self.end],), FULL, FULL))
        n = self.n_head + self.n_body + self.end
        return stored_attention(
            queries, segments, scale, 0, 0, None, sinks, valid=self.valid[:, :n], row_starts=self.row_starts
        )

    def hand_back(self, caches: list[LayerCache]) -> None:
        """Every member gets views of its rows back (head, body, its pending tokens)."""
        pk, pv = self.pending
        for i, (c, (h, b, p)) in enumerate(zip(caches, self.held, strict=True)):
            if self.head is not None and h:
                c.head_k, c.head_v = (x[i : i + 1, :, self.n_head - h :] for x in self.head)
            if self.body is not None and b:
                c._set_body(
                    tuple(x[i : i + 1, :, self.n_body - b :] for x in self.body[0]),
                    tuple(x[i : i + 1, :, self.n_body - b :] for x in self.body[1]),
                )
            first = self.built_end - p
            c.set_pending(pk[i : i + 1, :, first : self.end], pv[i : i + 1, :, first : self.end])
