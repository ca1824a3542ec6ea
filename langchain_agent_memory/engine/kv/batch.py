"""Several agents' layer caches stepped together in one batched forward pass.

Members join (``extend``) and leave (``filter``) between steps, as in mlx-lm's
``BatchGenerator``: the others keep their merged buffers; nothing is dissolved and rebuilt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..ops.cpu_attention import attention_over_decoded_prefix
from ..ops.runtime import mx
from . import fetches
from .buffers import Working, evaluated, grown_rows, in_space, own_copy
from .codecs import rotation
from .layer import LayerCache
from .recurrent import BatchRecurrentCache, RecurrentCache
from .stored import attention, positional_mask
from .stored_batch import StoredBatch

#: Fewer prefix rows than this: each member attends over its own copy (the prefix path's few
#: extra ops cost more than reading so few rows once per member saves).
_MIN_PREFIX_ROWS = 64
#: Above this many scores of the prefix rows in one call (a long prefill of several members),
#: each member attends alone: its own path tiles what would not fit.
_MAX_PREFIX_SCORES = 1 << 24


class BatchLayerCache:
    """One layer's caches of several agents, stepped together: the model runs one batched
    forward pass (every projection and MLP multiplies a (B, L, D) batch: decode reads the
    weights once for all agents), each agent at its own position (RoPE takes a vector of
    offsets). Attention:

    - full-attention layers: the agents' working copies merged into one left-padded buffer
      (built when the batch forms, appended in place for all agents at once, a member's
      rows handed back to it when it leaves), one attention call with a padding mask
      (``merge``; otherwise each agent over its own copy, as on sliding layers);
    - sliding-window layers: each agent over its own cache (windows slide apart).

    Either way each agent attends to exactly its own keys, as in a step alone. It satisfies
    mlx-lm's cache protocol too (``update_and_fetch`` returns padded real arrays,
    ``make_mask`` the padding mask): on a GPU the stock attention runs on it.
    """

    def __init__(
        self,
        caches: list[LayerCache],
        offsets: mx.array,
        merge: bool = True,
        merge_stored: bool = True,
        merge_prefix: bool = True,
    ) -> None:
        self.caches = list(caches)
        self._merges = merge  # full-attention layers over working copies: one merged buffer
        self._merges_stored = merge_stored  # ... over stored forms: one ``StoredBatch``
        # ... over copies that begin with a decoded prefix: their rows past it (``_Merged.prefix``)
        self._merges_prefix = merge_prefix
        # Every layer's RoPE reads the agents' positions before the step (shared array).
        self.offset = offsets
        self._merged: _Merged | None = None
        self._stored_batch: StoredBatch | None = None  # agents served from the stored form
        self._fetched: tuple[mx.array, mx.array] | None = None
        self._sliding = any(c.spec.window is not None for c in caches)
        # Served from the stored form: each agent attends over its own (``LayerCache.attend``).
        self._stored = any(c.serve_stored for c in caches)

    def step(self, offsets: mx.array) -> BatchLayerCache:
        """The same batch, one step later (its merged buffer kept)."""
        self.offset = offsets
        return self

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append each agent's new keys and values; return every agent's visible ones,
        left-padded to one length (``make_mask`` marks the padding)."""
        fetched = self._update_and_fetch(keys, values)
        fetches.note(fetched[0], self)
        return fetched

    def _update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self._fetched = None  # as in ``LayerCache``: its views would stop an in-place append
        sb = self._batch_stored()
        if sb is not None:  # one write for all agents; ``attend`` reads the stored batch
            sb.append(keys, values)
            for cache in self.caches:
                cache.offset += keys.shape[2]
            self._fetched = (keys, values)
            return self._fetched
        m = self._merge()
        if m is not None:
            # One write for all agents; each one's new tokens are split off its rows of the
            # buffer only when it leaves (for its commit).
            m.append(keys, values)
            for cache in self.caches:
                cache.offset += keys.shape[2]
            self._fetched = m.fetched()  # lazy where there is a decoded prefix: ``attend`` reads it
            return self._fetched
        n = len(self.caches)
        fetched = [
            c.update_and_fetch(k, v)
            for c, k, v in zip(self.caches, mx.split(keys, n), mx.split(values, n), strict=True)
        ]
        # Lazy: where ``attend`` runs instead (adapted model) the padded copy is never built.
        width = max(k.shape[2] for k, _ in fetched)
        self._fetched = (
            mx.concatenate([_left_pad(k, width) for k, _ in fetched], axis=0),
            mx.concatenate([_left_pad(v, width) for _, v in fetched], axis=0),
        )
        return self._fetched

    def fetched(self, keys: Any, values: Any) -> bool:
        """Whether ``keys`` / ``values`` are what ``update_and_fetch`` just returned."""
        f = self._fetched
        return f is not None and keys is f[0] and values is f[1]

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        """(B, 1, N, keys) mask over what ``update_and_fetch`` will return: each agent's own
        positions (causal, its window), never another agent's padding."""
        if self._batch_stored() is not None:
            return None  # ``attend`` masks by what each agent holds (``StoredBatch.valid``)
        m = self._merge()
        if m is not None:
            return m.mask(N)
        masks = []
        for c in self.caches:
            lo = c._first_visible(c.offset)
            masks.append(positional_mask(c.offset, N, lo, c.spec.window, True, c.spec.chunk))
        width = max(mask.shape[-1] for mask in masks)
        return mx.stack([_left_pad(mask, width, False) for mask in masks])[:, None]

    def _merge(self) -> _Merged | None:
        """The merged buffer of a full-attention layer (built at the batch's first step):
        the members' whole copies where the device merges (``merged_batch``), else their
        rows past a prefix they share (``_Merged.prefix``), or none."""
        if self._merged is None and not self._sliding and len(self.caches) > 1 and not self._stored:
            n = _decoded_rows(self.caches) if self._merges_prefix else 0
            if self._merges or n:
                self._merged = _Merged.of(self.caches, self.caches[0].dtype, n)
        return self._merged

    def _batch_stored(self) -> StoredBatch | None:
        """The stored batch of a full-attention layer whose agents attend on their stored
        form through ``LayerCache.attend`` (built at the batch's first step)."""
        if (
            self._stored_batch is None
            and self._merges_stored
            and self._stored
            and not self._sliding
            and len(self.caches) > 1
            and all(c._direct for c in self.caches)
        ):
            self._stored_batch = StoredBatch.of(self.caches)
        return self._stored_batch

    def attend(self, queries: mx.array, scale: float, sinks: mx.array | None = None) -> mx.array:
        if self._stored_batch is not None:
            return self._stored_batch.attend(queries, scale, sinks)
        m = self._merged
        if m is not None and m.prefix is not None and sinks is None:
            pk, pv = m.prefix
            k, v, valid = m.k[:, :, : m.end], m.v[:, :, : m.end], m.valid[:, : m.end]
            return attention_over_decoded_prefix(queries, pk, pv, k, v, valid, scale)
        if m is not None:
            k, v = m.fetched()
            return attention(queries, k, v, scale, m.mask(0), sinks)
        once = self._attend_prefix_once(queries, scale, sinks)
        if once is not None:
            return once
        parts = mx.split(queries, len(self.caches))
        return mx.concatenate(
            [c.attend(q, scale, sinks) for c, q in zip(self.caches, parts, strict=True)], axis=0
        )

    def _attend_prefix_once(self, queries: mx.array, scale: float, sinks: mx.array | None) -> mx.array | None:
        """Members whose working copies begin with the same decode of the same stored
        blocks (``Working.decoded_from``: a fan-out's siblings over one stored prompt): those
        rows read once for the whole batch, each member's own after them
        (``attention_over_decoded_prefix``), in a decode step or their tails' prefill. None
        where the members share too little, or the prefix product would be too large."""
        B, _, L, _ = queries.shape
        if sinks is not None or self._sliding or B < 2 or any(c.spec.chunk for c in self.caches):
            return None
        copies = [c.fetched_copy() for c in self.caches]
        first = copies[0]
        if first is None or any(c is None or c[:4] != first[:4] for c in copies):
            return None
        n, krot, vrot = first[1], first[2], first[3]
        if n < _MIN_PREFIX_ROWS or B * queries.shape[1] * L * n > _MAX_PREFIX_SCORES:
            return None
        own = [(k, v) for *_, k, v in copies]  # type: ignore[misc]
        if min(k.shape[2] for k, _ in own) < L:
            return None  # a query inside the prefix rows (not from a decode or a tail)
        width = max(k.shape[2] for k, _ in own)
        valid = mx.arange(width)[None] >= mx.array([width - k.shape[2] for k, _ in own])[:, None]
        q = queries @ rotation(queries.shape[-1]) if krot else queries
        out = attention_over_decoded_prefix(
            q,
            first[4],
            first[5],
            mx.concatenate([_left_pad(k, width) for k, _ in own], axis=0),
            mx.concatenate([_left_pad(v, width) for _, v in own], axis=0),
            valid,
            scale,
        )
        return out @ rotation(out.shape[-1]).T if vrot else out

    # ---------------------------------------------------------------- membership

    def filter(self, keep: list[int]) -> None:
        """Keep members ``keep`` (indices, in their new order); every other member gets its
        rows of the merged buffer back (its own working copy), to commit or go on alone."""
        if self._stored_batch is not None:  # leavers get their rows; the rest stay batched
            if len(keep) > 1:
                self._stored_batch.filter(keep, self.caches)
            else:
                self._stored_batch.hand_back(self.caches)
                self._stored_batch = None
        m = self._merged
        if m is not None:
            for i in range(len(self.caches)):
                if i not in keep:
                    m.hand_back(i, self.caches[i])
            self._merged = m.filter(keep) if len(keep) > 1 else None
            if self._merged is None:
                for i in keep:
                    m.hand_back(i, self.caches[i])
        self.caches = [self.caches[i] for i in keep]
        self._fetched = None

    def extend(self, caches: list[LayerCache]) -> None:
        """New members join after the current ones (their working copies merged in)."""
        if self._stored_batch is not None:
            if all(c._direct and c.serve_stored for c in caches):
                self._stored_batch.extend(caches)
            else:  # built again with them at the next step
                self._stored_batch.hand_back(self.caches)
                self._stored_batch = None
        m = self._merged
        if m is not None and m.prefix is not None and _decoded_rows(caches, m.origin) != m.prefix_rows:
            for i, cache in enumerate(self.caches):  # rebuilt with them at the next step, if at all
                m.hand_back(i, cache)
            self._merged = None
        elif m is not None:
            m.extend(caches)
        self.caches += caches
        self._sliding = any(c.spec.window is not None for c in self.caches)
        self._stored = any(c.serve_stored for c in self.caches)
        self._fetched = None

    def dissolve(self) -> None:
        """Every member leaves: each gets its rows back."""
        self.filter([])

    @property
    def state(self) -> list[Any]:
        return [c.state for c in self.caches]


@dataclass(slots=True)
class _Merged:
    """Several agents' visible K/V, right-aligned in one buffer (agent i's positions in
    columns ``[pads[i], end)``); ``valid`` marks the columns each agent may attend to;
    ``added[i]``: how many of agent i's newest tokens only this buffer holds.

    With a ``prefix`` (the agents' copies all begin with the same ``prefix_rows`` rows: a
    fan-out's siblings over one stored prompt), the buffer holds each agent's rows after
    it only and ``attend`` reads the prefix once for all (``attention_over_decoded_prefix``):
    joining copies ~50 rows per agent, not its whole context (on the CPU, merging 8 whole
    1K-token copies cost more than the steps saved), and a step reads the prefix once."""

    k: mx.array
    v: mx.array
    pads: list[int]
    end: int
    valid: mx.array
    added: list[int]
    prefix_rows: int = 0
    prefix: tuple[mx.array, mx.array] | None = None
    origin: object | None = None  # the ``Working.decoded_from`` of the prefix

    @classmethod
    def of(cls, caches: list[LayerCache], dtype: mx.Dtype, prefix_rows: int = 0) -> _Merged:
        m = cls(
            mx.zeros((0, 0, 0, 0), dtype),
            mx.zeros((0, 0, 0, 0), dtype),
            [],
            0,
            mx.zeros((0, 0), mx.bool_),
            [],
            prefix_rows,
        )
        m.extend(caches)
        return m

    def fetched(self) -> tuple[mx.array, mx.array]:
        """Every agent's visible keys and values, as mlx-lm's attention takes them (lazy
        with a prefix: built only where the model does not call ``attend``)."""
        k, v = self.k[:, :, : self.end], self.v[:, :, : self.end]
        if self.prefix is None:
            return k, v
        B, (pk, pv) = k.shape[0], self.prefix
        return (
            mx.concatenate([mx.broadcast_to(pk, (B, *pk.shape[1:])), k], axis=2),
            mx.concatenate([mx.broadcast_to(pv, (B, *pv.shape[1:])), v], axis=2),
        )

    def mask(self, N: int) -> mx.array:
        """(B, 1, 1, keys) mask over ``fetched`` after ``N`` more tokens."""
        valid = self.valid[:, : self.end + N]
        if self.prefix is not None:
            valid = mx.concatenate([mx.ones((valid.shape[0], self.prefix_rows), mx.bool_), valid], axis=1)
        return valid[:, None, None]

    def extend(self, caches: list[LayerCache]) -> None:
        n = self.prefix_rows
        if n:
            # Each copy as it is (after a prefill, in the codec's rotated space): only the
            # rows past the prefix are moved out of it, and the prefix once for all, not
            # every member's whole copy (8 siblings at 1K: ~200 ms of a first step).
            raw = []
            for c in caches:
                krot, vrot = c._visible(c.start, c.dtype, rotated=True)[2:]
                raw.append((*c.work.split_rows(), krot, vrot))
            if self.prefix is None:  # the first members: one's prefix rows stand for all
                pk, pv, _, _, krot, vrot = raw[0]
                self.prefix = (in_space(pk, krot, False), in_space(pv, vrot, False))
                self.origin = caches[0].work.buf.decoded_from  # type: ignore[union-attr]
            works = [(in_space(k, kr, False), in_space(v, vr, False)) for _, _, k, v, kr, vr in raw]
        else:
            works = [c._visible(c.start, c.dtype, rotated=False)[:2] for c in caches]
        for c in caches:
            c.work.buf = None  # from now on the merged buffer holds it
        end = max([self.end, *(k.shape[2] for k, _ in works)])
        cap = grown_rows(end)
        if self.pads:  # the current members: shift right by what the new end adds, room on the right
            shift, room = end - self.end, cap - end - (self.k.shape[2] - self.end)
            pad = [(0, 0), (0, 0), (shift, max(0, room)), (0, 0)]
            self.k, self.v = mx.pad(self.k, pad), mx.pad(self.v, pad)
            self.pads = [p + shift for p in self.pads]
        new_pads = [end - k.shape[2] for k, _ in works]
        width = self.k.shape[2] if self.pads else cap

        def rows(j: int) -> list[mx.array]:
            return [
                mx.pad(w[j], [(0, 0), (0, 0), (p, width - end), (0, 0)])
                for w, p in zip(works, new_pads, strict=True)
            ]

        self.k = mx.concatenate(([self.k] if self.pads else []) + rows(0), axis=0)
        self.v = mx.concatenate(([self.v] if self.pads else []) + rows(1), axis=0)
        self.pads += new_pads
        self.added += [0] * len(caches)
        self.end = end
        self.valid = mx.arange(self.k.shape[2])[None, :] >= mx.array(self.pads)[:, None]

    def append(self, keys: mx.array, values: mx.array) -> None:
        n = keys.shape[2]
        if self.end + n > self.k.shape[2]:
            extra = grown_rows(self.end + n) - self.k.shape[2]
            grow = [(0, 0), (0, 0), (0, extra), (0, 0)]
            self.k, self.v = mx.pad(self.k, grow), mx.pad(self.v, grow)
            self.valid = mx.pad(self.valid, [(0, 0), (0, extra)], constant_values=True)
        self.k[:, :, self.end : self.end + n] = keys.astype(self.k.dtype)
        self.v[:, :, self.end : self.end + n] = values.astype(self.v.dtype)
        self.end += n
        self.added = [a + n for a in self.added]

    def hand_back(self, i: int, cache: LayerCache) -> None:
        """Give member ``i`` its rows, copied out of the merged buffer (``own_copy``): its
        newest tokens as pending, the rest as its working copy. As views, a parked agent's
        copy kept the whole batch's buffer alive (four agents that decoded together: each
        held all four's rows and the room, beyond what the hot tier's budget counts)."""
        k = own_copy(self.k[i : i + 1, :, self.pads[i] : self.end])
        v = own_copy(self.v[i : i + 1, :, self.pads[i] : self.end])
        evaluated(k, v)  # now: the merged buffer is free once the batch lets go of it
        new = self.added[i]
        if new:
            cache.offset -= new
            cache.push_pending(k[:, :, -new:], v[:, :, -new:])
        if self.prefix is None:
            cache.work.buf = Working(k, v, cache.start, cache.offset)
            return
        # Its copy again (lazy: built where it is read, as the next turn's, not here).
        pk, pv = self.prefix
        k, v = mx.concatenate([pk, k], axis=2), mx.concatenate([pv, v], axis=2)
        cache.work.buf = Working(
            k, v, cache.start, cache.offset, decoded_from=self.origin, decoded_rows=self.prefix_rows
        )

    def filter(self, keep: list[int]) -> _Merged:
        """The buffer of members ``keep`` only (columns no member uses any more dropped)."""
        idx = mx.array(keep)
        cut = min(self.pads[i] for i in keep)
        return _Merged(
            self.k[idx, :, cut:],
            self.v[idx, :, cut:],
            [self.pads[i] - cut for i in keep],
            self.end - cut,
            self.valid[idx, cut:],
            [self.added[i] for i in keep],
            self.prefix_rows,
            self.prefix,
            self.origin,
        )


def _decoded_rows(caches: list[LayerCache], origin: object | None = None) -> int:
    """How many leading rows every member's working copy holds of one decode of the same
    stored blocks (``Working.decoded_from``; ``origin`` where given), where the model attends
    through the caches (``attend``, an adapted model: ``prefill_rotated``) and there are
    enough of them to read once for all; else 0."""
    if not all(c.prefill_rotated and not c.serve_stored and c.spec.chunk is None for c in caches):
        return 0
    origins = set()
    rows = set()
    for c in caches:
        if c.offset > c.start and c.work.buf is None:
            c._visible(c.start, c.dtype, rotated=True)  # what the merge would build anyway
        w = c.work.buf
        if w is None or w.decoded_from is None or w.start != c.start:
            return 0
        origins.add(id(w.decoded_from))
        rows.add(w.decoded_rows)
    if origin is not None:
        origins.add(id(origin))
    n = rows.pop() if len(rows) == 1 and len(origins) == 1 else 0
    return n if n >= _MIN_PREFIX_ROWS and all(c.offset - c.start > n for c in caches) else 0


def _left_pad(x: mx.array, width: int, value: Any = 0) -> mx.array:
    """``x`` padded on the left of its key axis (the last but one for K/V, the last for a
    mask) to ``width``."""
    axis = x.ndim - 1 if x.dtype == mx.bool_ else 2
    pad = [(0, 0)] * x.ndim
    pad[axis] = (width - x.shape[axis], 0)
    return mx.pad(x, pad, constant_values=value) if width > x.shape[axis] else x


def batch_layer_caches(
    per_agent: list[list[LayerCache]],
    merge: bool = True,
    merge_stored: bool = True,
    merge_prefix: bool = True,
) -> list[BatchLayerCache]:
    """Layer-major view of several agents' layer caches, for batched forward passes (keep
    it for the next steps: ``step``; members join with ``extend`` and leave with ``filter``);
    ``merge``: working copies of full-attention layers merged into one buffer; ``merge_stored``:
    stored forms into one ``StoredBatch``; ``merge_prefix``: copies that begin with the same
    prefix decode, their rows past it merged (all off: each agent attends over its own, as
    in a one-pass batch whose members never leave it to get their rows back)."""
    offsets = mx.array([layers[0].offset for layers in per_agent])
    return [
        BatchRecurrentCache(list(layer), offsets)  # type: ignore[misc]
        if isinstance(layer[0], RecurrentCache)
        else BatchLayerCache(list(layer), offsets, merge, merge_stored, merge_prefix)
        for layer in zip(*per_agent, strict=True)
    ]
