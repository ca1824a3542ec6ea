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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..ops.runtime import mx
from . import fetches
from .buffers import Working, grown_rows, in_space, slice_parts, with_room
from .codecs import FULL, HALF_DTYPE, KVQuant, rotation
from .layer_blocks import LayerBlocks
from .layer_work import WorkingCopy
from .recurrent import RecurrentCache
from .spec import LayerSpec, ModelCacheSpec
from .stored import Parts, Segment, attention, positional_mask, stored_attention


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


class LayerCache(LayerBlocks, WorkingCopy):
    """One layer of one agent's cache (mlx-lm cache protocol: ``offset``,
    ``update_and_fetch``, ``make_mask``), positions ``[start, offset)`` held in memory:

    - head: positions ``[0, n_head)`` at 16 bits (``KVQuant.head_tokens``; only while
      ``start == 0``),
    - body: positions ``[body_start, committed_end)`` in the KV format,
    - pending: this request's tokens ``[committed_end, offset)`` at full precision.
    """

    def __init__(
        self,
        spec: LayerSpec,
        quant: KVQuant,
        dtype: mx.Dtype,
        prefill_rotated: bool = False,
        reserved_rows: int = 0,
        serve_stored: bool = False,
    ) -> None:
        self.spec = spec
        self.quant = quant
        self.dtype = dtype
        self.start = 0  # absolute position of the first token held in memory
        self.offset = 0  # absolute position after the last token
        self.head_k: mx.array | None = None  # committed first tokens, 16-bit
        self.head_v: mx.array | None = None
        # Committed body in stored form: buffers with room for appends (a commit then
        # writes only its new tokens), the first ``_n_body`` positions valid.
        self._kbuf: Parts | None = None
        self._vbuf: Parts | None = None
        self._n_body = 0
        # This request's tokens at full precision, as appended; joined when read into the
        # first entry, a buffer with room (its first ``_pending_rows`` valid): a decode step
        # that reads them (``serve_stored``) then writes one row, not a copy of all of them.
        self._pending: list[tuple[mx.array, mx.array]] = []
        self._pending_rows = 0
        self._n_pending = 0
        self._work: Working | None = None  # see ``_visible``; dropped when the request ends
        self._fetched: _Fetched | None = None  # what the last ``update_and_fetch`` returned
        #: Prefill in the codec's rotated space (``attend``): on where an adapted model
        #: calls ``attend``; off, the working copy is kept in the model's own space.
        self.prefill_rotated = prefill_rotated
        #: Rows of the working-copy buffers the engine reserved for this layer (``reserve``).
        self.reserved_rows = reserved_rows
        #: Attend on the stored form (``stored``): no full-precision working copy is built.
        self.serve_stored = serve_stored
        # ``attend`` ran on what ``update_and_fetch`` returned: later fetches return the new
        # keys as placeholders instead of building a full-precision graph nobody evaluates.
        self._direct = False

    # ---------------------------------------------------------------- sizes

    @property
    def keys(self) -> Parts | None:
        """The committed body's keys in stored form (views of the buffer)."""
        return self._body_view(self._kbuf)

    @property
    def values(self) -> Parts | None:
        return self._body_view(self._vbuf)

    def _body_view(self, buf: Parts | None) -> Parts | None:
        if buf is None:
            return None
        return buf if buf[0].shape[2] == self._n_body else slice_parts(buf, 0, self._n_body)

    def _set_body(self, keys: Parts | None, values: Parts | None) -> None:
        self._kbuf, self._vbuf = keys, values
        self._n_body = 0 if keys is None else keys[0].shape[2]

    def _append_body(self, keys: Parts, values: Parts) -> None:
        """Add newly encoded tokens to the committed body, in place while there is room."""
        if self._kbuf is None or self._vbuf is None:
            self._set_body(keys, values)
            return
        n, m = self._n_body, keys[0].shape[2]
        if n + m > self._kbuf[0].shape[2]:
            # A thirty-second more: the body is what a parked agent holds (an eighth of room
            # was an eighth fewer agents in a memory budget), and it grows by whole blocks,
            # once a turn at most; a copy of the stored form costs little on a GPU.
            rows = grown_rows(n + m, share=32)
            self._kbuf = tuple(with_room(x, n, rows) for x in self._kbuf)
            self._vbuf = tuple(with_room(x, n, rows) for x in self._vbuf)
        for buf, new in ((self._kbuf, keys), (self._vbuf, values)):
            for x, y in zip(buf, new, strict=True):
                x[:, :, n : n + m] = y
        self._n_body = n + m

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
        self._n_pending = self._pending_rows = 0 if keys is None else keys.shape[2]

    def _joined_pending(self) -> tuple[mx.array | None, mx.array | None]:
        if not self._pending:
            return None, None
        n = self._n_pending
        if len(self._pending) > 1:
            (k, v), extra = self._pending[0], self._pending[1:]
            used = self._pending_rows
            if n > k.shape[2]:  # grow with room: the next appends are written in place
                rows = grown_rows(n)
                k, v = with_room(k, used, rows), with_room(v, used, rows)
            for nk, nv in extra:
                m = nk.shape[2]
                k[:, :, used : used + m] = nk.astype(k.dtype)
                v[:, :, used : used + m] = nv.astype(v.dtype)
                used += m
            self._pending, self._pending_rows = [(k, v)], n
        k, v = self._pending[0]
        return (k, v) if k.shape[2] == n else (k[:, :, :n], v[:, :, :n])

    @property
    def n_head(self) -> int:
        return 0 if self.head_k is None else self.head_k.shape[2]

    @property
    def body_start(self) -> int:
        return self.start + self.n_head

    @property
    def nbytes(self) -> int:
        arrays = [*(self._kbuf or ()), *(self._vbuf or ())]
        arrays += [a for a in (self.head_k, self.head_v) if a is not None]
        arrays += [a for pair in self._pending for a in pair]
        return sum(int(a.nbytes) for a in arrays)

    # ---------------------------------------------------------------- mlx-lm protocol

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append this step's keys and values; return every key and value the step's queries
        can see (a sliding layer's window), at full precision, in the model's space."""
        L = keys.shape[2]
        # The last step's views of the working copy go first: while they live, the append
        # below cannot update the copy in place (mlx would copy all of it, every step).
        self._fetched = None
        if self.serve_stored:
            self.push_pending(keys, values)
            if self._direct:  # ``attend`` reads the stored form: nothing to build here
                out_k, out_v = keys, values
            else:  # for attention code of the model's own (a MLA layer's derived keys)
                lo = self._first_visible(self.offset - L)
                out_k, out_v = self._decoded(lo, keys.dtype, False, False)
            self._fetched = _Fetched(out_k, out_v, out_k, out_v, False, False)
            fetches.note(out_k, self)
            return out_k, out_v
        if self._work is not None and self._work.end == self.offset:
            self._append_work(keys, values)
        self.push_pending(keys, values)
        lo = self._first_visible(self.offset - L)
        k, v, krot, vrot = self._visible(lo, keys.dtype, rotated=self.prefill_rotated and L > 1)
        # Lazy: where ``attend`` is called instead (adapted model), these are never computed.
        out_k, out_v = in_space(k, krot, False), in_space(v, vrot, False)
        self._fetched = _Fetched(out_k, out_v, k, v, krot, vrot)
        fetches.note(out_k, self)
        return out_k, out_v

    def fetched(self, keys: Any, values: Any) -> bool:
        """Whether ``keys`` / ``values`` are what ``update_and_fetch`` just returned (an MLA
        layer may attend over arrays it derived from them instead)."""
        f = self._fetched
        return f is not None and keys is f.keys and values is f.values

    def push_pending(self, keys: mx.array, values: mx.array) -> None:
        """Add this request's new tokens (without touching the working copy)."""
        if not self._pending:
            self._pending_rows = keys.shape[2]
        self._pending.append((keys, values))
        self._n_pending += keys.shape[2]
        self.offset += keys.shape[2]

    def unfeed(self, n: int) -> None:
        """Forget this request's last ``n`` tokens: a decode step fed a token before it was
        known that the token ended the turn (``steps``: the next step's graph is built while
        this one runs). The working copy keeps its rows as spare room."""
        if n > self._n_pending:
            raise RuntimeError(f"unfeed {n} of {self._n_pending} pending tokens (this is a bug)")
        self._joined_pending()
        keep = self._n_pending - n
        if keep:  # the buffer stays: its rows past ``keep`` are room for the next appends
            self._n_pending = self._pending_rows = keep
        else:
            self.set_pending(None, None)
        self.offset -= n
        self._fetched = None
        w = self._work
        if w is not None and w.end > self.offset:
            w.end = self.offset

    def make_mask(
        self, N: int, return_array: bool = False, window_size: int | None = None
    ) -> mx.array | str | None:
        """The mask of the next ``N`` queries over what ``update_and_fetch`` will return
        (this layer's own window; mlx-lm's ``window_size`` names the same one)."""
        first_q = self.offset
        lo = self._first_visible(first_q)
        return positional_mask(first_q, N, lo, self.spec.window, return_array, self.spec.chunk)

    def _first_visible(self, first_q: int) -> int:
        """The first position a query at ``first_q`` or later can see (and is held)."""
        window, chunk = self.spec.window, self.spec.chunk
        if chunk is not None:
            return max(self.start, first_q // chunk * chunk)
        return self.start if window is None else max(self.start, first_q - window + 1)

    @property
    def start_position(self) -> int:
        """mlx-lm's ``ChunkedKVCache.start_position``: the first key the next fetch returns
        (Llama 4 makes its chunk mask from it)."""
        return self._first_visible(self.offset)

    def maybe_trim_front(self) -> None:
        """mlx-lm's ``ChunkedKVCache`` drops keys before the chunk here; the engine keeps them
        (stored in blocks like any layer's: a DIVERGE may go back into an earlier chunk)."""

    def is_trimmable(self) -> bool:
        return True

    @property
    def state(self) -> tuple[Any, ...]:
        return (self.head_k, self.head_v, self._kbuf, self._vbuf, self._pending)

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
                (
                    slice_parts(self.keys, a, b),
                    slice_parts(self.values, a, b),
                    self.quant.keys,
                    self.quant.values,
                )
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
        if self.serve_stored:
            self._direct = True
            lo = self._first_visible(self.offset - L)
            return stored_attention(
                queries, self._segments(lo), scale, self.offset - L, lo, self.spec.window, sinks
            )
        q = queries @ rotation(queries.shape[-1]) if f.krot else queries
        n_keys = f.k.shape[2]
        mask = positional_mask(
            self.offset - L, L, self.offset - n_keys, self.spec.window, False, self.spec.chunk
        )
        out = attention(q, f.k, f.v, scale, mask, sinks)
        return out @ rotation(out.shape[-1]).T if f.vrot else out

    def held_kv(self, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
        """Every key and value held, positions ``[start, offset)``, at full precision in the
        model's space (the self-check compares them with mlx-lm's)."""
        return self._decoded(self.start, dtype, False, False)

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        """mlx-lm's ``KVCache.keys_and_values``, for layers of the model that attend over
        another layer's keys and values (Gemma 3n's KV-shared layers, AFM's KV-reuse ones):
        what the last ``update_and_fetch`` returned (the positions the model's mask is made
        for; the engine's attention knows them by identity), else all that is held."""
        f = self._fetched
        if f is None:
            return self.held_kv(self.dtype)
        if self._direct:  # placeholders of the stored form: the real ones (AFM reads their length)
            lo = self._first_visible(self.offset - f.keys.shape[2])
            return self._decoded(lo, f.keys.dtype, False, False)
        return f.keys, f.values

    # ---------------------------------------------------------------- lifecycle

    def commit(self, keep_work: bool = False, keep_from: int = 0) -> None:
        """Move this request's tokens into the committed (stored) form.

        ``keep_work``: keep the full-precision working copy for the agent's next request
        (which then unpacks nothing), with this request's rows replaced by what the stored
        form decodes to: the next request sees exactly what a reload from disk would.
        ``keep_from``: the first position the layer keeps after this commit (a sliding
        layer's, ``drop_before``): rows before it are not decoded again.
        """
        k, v = self._joined_pending()
        if k is None or v is None:
            return
        first = self.committed_end
        n_head = max(0, min(self.quant.head_tokens, self.offset) - self.committed_end)
        if n_head and self.start == 0 and self._kbuf is None:
            hk, hv = k[:, :, :n_head].astype(HALF_DTYPE), v[:, :, :n_head].astype(HALF_DTYPE)
            self.head_k = hk if self.head_k is None else mx.concatenate([self.head_k, hk], axis=2)
            self.head_v = hv if self.head_v is None else mx.concatenate([self.head_v, hv], axis=2)
            k, v = k[:, :, n_head:], v[:, :, n_head:]
        if k.shape[2]:
            self._append_body(self.quant.keys.encode(k), self.quant.values.encode(v))
        self.set_pending(None, None)
        self._fetched = None
        w = self._work
        if not keep_work or w is None or w.end != self.offset:
            self._work = None  # the request is over: only the stored form stays in memory
            return
        # A sliding layer's copy may start after this request's first rows (``_append_work``
        # let them go): a later request that needs them rebuilds from the stored form.
        lo = max(first, w.start, keep_from)
        if lo >= self.offset:
            return
        dk, dv = self._decoded(lo, w.k.dtype, w.krot, w.vrot)
        a, b = lo - w.start, self.offset - w.start
        w.k[:, :, a:b] = dk
        w.v[:, :, a:b] = dv
        mx.eval(w.k, w.v)  # not a graph holding this request's arrays until the next one

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
        if self._kbuf is not None and self._vbuf is not None:
            n = self.committed_end - b0
            self._set_body(slice_parts(self._kbuf, cut - b0, n), slice_parts(self._vbuf, cut - b0, n))
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
            self._set_body(None, None)
            if self.head_k is not None and self.head_v is not None:
                self.head_k, self.head_v = self.head_k[:, :, :n_tokens], self.head_v[:, :, :n_tokens]
                if n_tokens == 0:
                    self.head_k = self.head_v = None
        elif self._kbuf is not None:
            self._n_body = n_tokens - b0  # later positions: room for the next appends
        self.offset = n_tokens


def make_layer_caches(
    spec: ModelCacheSpec,
    quant: KVQuant,
    prefill_rotated: bool = False,
    reserved_rows: Sequence[int] | None = None,
    serve_stored: bool = False,
) -> list[LayerCache]:
    """One agent's empty layer caches, each in ``quant`` fitted to its head widths
    (``KVQuant.for_dims``; ``prefill_rotated``, ``reserved_rows`` (per layer),
    ``serve_stored``: see ``LayerCache``); a hybrid model's recurrent layers get a
    ``RecurrentCache`` (typed as a layer: it has the part of the protocol they use)."""
    dtype = getattr(mx, spec.dtype)
    reserved = reserved_rows or [0] * spec.num_layers
    return [
        RecurrentCache(s)  # type: ignore[misc]
        if s.recurrent
        else LayerCache(
            s, quant.for_dims(s.k_head_dim, s.v_head_dim), dtype, prefill_rotated, r, serve_stored
        )
        for s, r in zip(spec.layers, reserved, strict=True)
    ]
