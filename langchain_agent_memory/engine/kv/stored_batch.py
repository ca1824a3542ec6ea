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

from ..ops.runtime import mx
from . import stored_cuda
from .buffers import evaluated, own_copy
from .codecs import FULL, HALF_DTYPE, KVQuant
from .layer import LayerCache
from .stored import Parts, Segment, stored_attention

#: Columns of room for the steps' new tokens: a step writes one column for every member, and
#: growing copies only the members' own 16-bit tokens. The layer caches' step (256, with an
#: eighth more) was 1.6 GB of empty 16-bit columns for 48 agents of an 8B model on the H200.
PENDING_STEP = 32


def _pending_cols(needed: int) -> int:
    want = needed + max(PENDING_STEP, needed // 8)
    return -(-want // PENDING_STEP) * PENDING_STEP


def _left(x: mx.array, width: int, room: int = 0) -> mx.array:
    """``x`` (1, heads, n, ·) zero-padded on the left of its key axis to ``width`` (then
    ``room`` more columns on the right)."""
    n = x.shape[2]
    return mx.pad(x, [(0, 0), (0, 0), (width - n, room), (0, 0)]) if width - n or room else x


Pair = tuple[mx.array, mx.array]
Held = list[tuple[int, int, int]]
#: Rows right-aligned per region: (head, body, pending tokens, each row's token counts).
Group = tuple[Pair | None, tuple[Parts, Parts] | None, Pair | None, Held]


def _member(c: LayerCache) -> Group:
    """One agent's held K/V as a group of one row (its arrays, not copies)."""
    head = (c.head_k, c.head_v) if c.head_k is not None and c.head_v is not None else None
    body = (c.keys, c.values) if c.keys is not None and c.values is not None else None
    pk, pv = c.pending.joined()
    pending = (pk, pv) if pk is not None and pv is not None else None
    held = (
        0 if head is None else head[0].shape[2],
        0 if body is None else body[0][0].shape[2],
        0 if pending is None else pending[0].shape[2],
    )
    return head, body, pending, [held]


def _join(groups: list[Group]) -> Group:
    """The groups' rows in one batch: each region left-padded to its widest row, the
    pending tokens with room for the next steps (``_pending_cols``)."""
    held = [h for g in groups for h in g[3]]
    n_head, n_body, n_pend = (max(x[j] for x in held) for j in range(3))

    def cat(arrays: list[mx.array | None], like: mx.array, width: int, extra: int = 0) -> mx.array:
        empty = like[:1, :, :0]
        return mx.concatenate([_left(a if a is not None else empty, width, extra) for a in arrays])

    head = None
    if n_head:
        ref = next(g[0] for g in groups if g[0] is not None)
        head = tuple(
            cat([None if g[0] is None else g[0][side] for g in groups], ref[side], n_head).astype(HALF_DTYPE)
            for side in (0, 1)
        )
    body = None
    if n_body:
        ref_body = next(g[1] for g in groups if g[1] is not None)
        body = tuple(
            tuple(
                cat([None if g[1] is None else g[1][side][j] for g in groups], ref_body[side][j], n_body)
                for j in range(len(ref_body[side]))
            )
            for side in (0, 1)
        )
    ref_pend = next(g[2] for g in groups if g[2] is not None)
    room = _pending_cols(n_pend + 1) - n_pend
    pending = tuple(
        cat([None if g[2] is None else g[2][side] for g in groups], ref_pend[side], n_pend, room)
        for side in (0, 1)
    )
    return head, body, pending, held


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

    @classmethod
    def of(cls, caches: list[LayerCache]) -> StoredBatch:
        """The batch of ``caches`` (their held K/V handed over to it)."""
        head, body, pending, held = _join([_member(c) for c in caches])
        none = mx.zeros((0, 0), mx.bool_)
        batch = cls(caches[0].quant, head, body, pending, 0, 0, 0, none, none, held)
        batch._reset(held)
        for c in caches:  # handed over: the batch holds them now
            _release(c)
        evaluated(batch.head, batch.body, batch.pending)
        return batch

    def _reset(self, held: list[tuple[int, int, int]]) -> None:
        """Widths, ``valid`` and ``row_starts`` of the rows ``held``; the pending buffer
        gets room for the next steps where it has too little (``filter`` keeps its own)."""
        self.held = held
        self.n_head, self.n_body, self.end = (max(x[j] for x in held) for j in range(3))
        pk, pv = self.pending
        cap = _pending_cols(self.end + 1)
        if pk.shape[2] < cap:
            grow = [(0, 0), (0, 0), (0, cap - pk.shape[2]), (0, 0)]
            self.pending = (mx.pad(pk, grow), mx.pad(pv, grow))
        cols = mx.arange(self.n_head + self.n_body + self.pending[0].shape[2])[None]
        counts = mx.array(held)

        def region(first: int, width: int, count: mx.array) -> mx.array:
            """Each member's last ``count`` columns of the region ``[first, first + width)``."""
            return (cols >= first + width - count) & (cols < first + width)

        self.valid = (
            region(0, self.n_head, counts[:, :1])
            | region(self.n_head, self.n_body, counts[:, 1:2])
            | region(self.n_head + self.n_body, self.end, counts[:, 2:3])
        )
        self.row_starts = mx.array(
            [[self.n_body - b, self.n_head - h, self.end - p, stored_cuda.ALL_VISIBLE] for h, b, p in held],
            dtype=mx.int32,
        )

    def _group(self) -> Group:
        """The current members as one group (their pending tokens are ``[.., end)``)."""
        pk, pv = self.pending
        return self.head, self.body, (pk[:, :, : self.end], pv[:, :, : self.end]), list(self.held)

    def extend(self, caches: list[LayerCache]) -> None:
        """New members join after the current ones (one copy of the batch, not two)."""
        head, body, pending, held = _join([self._group(), *(_member(c) for c in caches)])
        self.head, self.body, self.pending = head, body, pending
        self._reset(held)
        for c in caches:
            _release(c)
        evaluated(self.head, self.body, self.pending)

    def filter(self, keep: list[int], caches: list[LayerCache]) -> None:
        """Members ``keep`` (indices into ``caches``, the current members in order) stay;
        every other one gets its rows back (``hand_back``)."""
        leaving = [i for i in range(len(caches)) if i not in set(keep)]
        self._give(leaving, caches)
        idx = mx.array(keep)
        held = [self.held[i] for i in keep]
        h, b, p = (max(x[j] for x in held) for j in range(3))
        # The kept rows, columns no kept member uses dropped.
        if self.head is not None:
            hk, hv = (x[idx, :, self.n_head - h :] for x in self.head)
            self.head = (hk, hv) if h else None
        if self.body is not None:
            bk, bv = (tuple(x[idx, :, self.n_body - b :] for x in side) for side in self.body)
            self.body = (bk, bv) if b else None
        pk, pv = (x[idx, :, self.end - p : self.end] for x in self.pending)
        self.pending = (pk, pv)
        self._reset(held)
        evaluated(self.head, self.body, self.pending)

    def append(self, keys: mx.array, values: mx.array) -> None:
        """One step's keys and values, one column for every member."""
        n = keys.shape[2]
        pk, pv = self.pending
        if self.end + n > pk.shape[2]:
            extra = _pending_cols(self.end + n) - pk.shape[2]
            grow = [(0, 0), (0, 0), (0, extra), (0, 0)]
            pk, pv = mx.pad(pk, grow), mx.pad(pv, grow)
            self.valid = mx.pad(self.valid, [(0, 0), (0, extra)], constant_values=False)
        pk[:, :, self.end : self.end + n] = keys.astype(pk.dtype)
        pv[:, :, self.end : self.end + n] = values.astype(pv.dtype)
        at = self.n_head + self.n_body + self.end
        self.valid[:, at : at + n] = True
        self.pending = (pk, pv)
        self.end += n
        self.held = [(h, b, q + n) for h, b, q in self.held]

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
            queries, segments, scale, 0, 0, None, sinks, valid=self.valid[:, :n], row_starts=self.row_starts,
            full_body=self.quant.keys.bits is None,
        )  # fmt: skip

    def hand_back(self, caches: list[LayerCache]) -> None:
        """Every member gets its rows back (the batch is done)."""
        self._give(list(range(len(caches))), caches)

    def _give(self, rows: list[int], caches: list[LayerCache]) -> None:
        """Members ``rows`` get copies of their rows (head, body, pending tokens), not views:
        a view would keep the whole batch's buffers alive while any member holds one."""
        pk, pv = self.pending
        made: list[mx.array] = []
        for i in rows:
            c, (h, b, p) = caches[i], self.held[i]
            if self.head is not None and h:
                hk, hv = (own_copy(x[i : i + 1, :, self.n_head - h :]) for x in self.head)
                c.committed.head_k, c.committed.head_v = hk, hv
                made += [hk, hv]
            if self.body is not None and b:
                bk, bv = (
                    tuple(own_copy(x[i : i + 1, :, self.n_body - b :]) for x in side) for side in self.body
                )
                c.committed.set_body(bk, bv)
                made += [*bk, *bv]
            k, v = (own_copy(x[i : i + 1, :, self.end - p : self.end]) for x in (pk, pv))
            c.set_pending(k, v)
            made += [k, v]
        evaluated(made)


def _release(c: LayerCache) -> None:
    c.committed.head_k = c.committed.head_v = None
    c.committed.set_body(None, None)
    c.set_pending(None, None)
