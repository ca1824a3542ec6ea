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
from operator import attrgetter
from typing import Any

from ..ops.runtime import mx
from . import fetches
from .buffers import Pending, in_space
from .codecs import FULL, KVQuant, rotation
from .layer_blocks import CommittedKV, Pair, block_tensors, stored_of_blocks, tensor_name
from .layer_work import WorkingCopy, decode_segments
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


def _of(path: str, doc: str | None = None) -> Any:
    """A read-only attribute that is one of a layer's parts' (``path``: ``part.name``)."""
    return property(attrgetter(path), doc=doc or f"The layer's ``{path}``.")


class LayerCache:
    """One layer of one agent's cache (mlx-lm cache protocol: ``offset``,
    ``update_and_fetch``, ``make_mask``), positions ``[start, offset)`` held in memory:

    - ``committed``: positions ``[start, committed_end)`` in stored form (a 16-bit head, then
      the body in the KV format; ``layer_blocks``),
    - ``pending``: this request's tokens ``[committed_end, offset)`` at full precision,
    - ``work``: while a request runs, the positions its queries see at full precision
      (``layer_work``; none with ``serve_stored``).
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
        self.dtype = dtype
        self.offset = 0  # absolute position after the last token
        self.committed = CommittedKV(quant)
        self.pending = Pending()
        # ``reserved_rows``: rows of its buffers the engine reserved for this layer (``reserve``).
        self.work = WorkingCopy(reserved_rows)
        self._fetched: _Fetched | None = None  # what the last ``update_and_fetch`` returned
        #: Prefill in the codec's rotated space (``attend``): on where an adapted model
        #: calls ``attend``; off, the working copy is kept in the model's own space.
        self.prefill_rotated = prefill_rotated
        #: Attend on the stored form (``stored``): no full-precision working copy is built.
        self.serve_stored = serve_stored
        # ``attend`` ran on what ``update_and_fetch`` returned: later fetches return the new
        # keys as placeholders instead of building a full-precision graph nobody evaluates.
        self._direct = False

    # ---------------------------------------------------------------- parts and sizes

    # Read-only views of the parts' state (``attrgetter``: no Python frame per read).
    quant = _of("committed.quant")
    start = _of("committed.start", "Absolute position of the first token held in memory.")
    head_k = _of("committed.head_k", "Committed first tokens' keys, 16-bit (None: none).")
    head_v = _of("committed.head_v")
    keys = _of("committed.keys", "The committed body's keys in stored form (views of the buffer).")
    values = _of("committed.values")
    n_head = _of("committed.n_head")
    body_start = _of("committed.body_start")
    reserved_rows = _of("work.reserved_rows", "Working-copy rows the engine reserved (``reserve``).")
    work_nbytes = _of("work.nbytes", "Bytes of the full-precision working copy (0 when none is kept).")
    _work = _of("work.buf", "The working copy's buffer (tests and benchmarks look at it).")

    @property
    def committed_end(self) -> int:
        return self.offset - self.pending.n

    @property
    def pending_k(self) -> mx.array | None:
        return self.pending.joined()[0]

    @property
    def pending_v(self) -> mx.array | None:
        return self.pending.joined()[1]

    def set_pending(self, keys: mx.array | None, values: mx.array | None) -> None:
        """Replace this request's tokens (``offset`` is the caller's to keep right)."""
        self.pending.set(keys, values)

    @property
    def nbytes(self) -> int:
        return self.committed.nbytes + self.pending.nbytes

    def drop_work(self) -> None:
        """Free the working copy (the next request unpacks the stored form again)."""
        self.work.buf = None

    def unpack(self, dtype: mx.Dtype) -> None:
        """Build the working copy of what the layer holds now, ahead of the request that
        would build it before its first token (a prefetch: the agent's turn is not yet here).
        Nothing to build where requests attend over the stored form (``serve_stored``)."""
        if self.serve_stored or not self.offset:
            return
        self.work.visible(self._first_visible(self.offset), self.offset, dtype, False, self._segments)
        w = self.work.buf
        if w is not None:
            mx.eval(w.k, w.v)

    # ---------------------------------------------------------------- mlx-lm protocol

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append this step's keys and values; return every key and value the step's queries
        can see (a sliding layer's window), at full precision, in the model's space."""
        L = keys.shape[2]
        # The last step's views of the working copy go first: while they live, the append
        # below cannot update the copy in place (mlx would copy all of it, every step).
        self._fetched = None
        if self.serve_stored:
            self.pending.push(keys, values)
            self.offset += L
            if self._direct:  # ``attend`` reads the stored form: nothing to build here
                out_k, out_v = keys, values
            else:  # for attention code of the model's own (a MLA layer's derived keys)
                lo = self._first_visible(self.offset - L)
                out_k, out_v = self._decoded(lo, keys.dtype, False, False)
            self._fetched = _Fetched(out_k, out_v, out_k, out_v, False, False)
            fetches.note(out_k, self)
            return out_k, out_v
        work = self.work
        work.append(keys, values, self.offset, self._first_visible)
        self.pending.push(keys, values)
        self.offset += L
        lo = self._first_visible(self.offset - L)
        rotated = self.prefill_rotated and L > 1
        k, v, krot, vrot = work.visible(lo, self.offset, keys.dtype, rotated, self._segments, self.pending.n)
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
        self.pending.push(keys, values)
        self.offset += keys.shape[2]

    def unfeed(self, n: int) -> None:
        """Forget this request's last ``n`` tokens: a decode step fed a token before it was
        known that the token ended the turn (``steps``: the next step's graph is built while
        this one runs). The working copy keeps its rows as spare room."""
        pending = self.pending
        if n > pending.n:
            raise RuntimeError(f"unfeed {n} of {pending.n} pending tokens (this is a bug)")
        pending.keep(pending.n - n)
        self.offset -= n
        self._fetched = None
        self.work.unfeed(self.offset)

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
        window, chunk, start = self.spec.window, self.spec.chunk, self.committed.start
        if chunk is not None:
            return max(start, first_q // chunk * chunk)
        return start if window is None else max(start, first_q - window + 1)

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
        c = self.committed
        return (c.head_k, c.head_v, c.kbuf, c.vbuf, self.pending.chunks)

    # ---------------------------------------------------------------- attention

    def _segments(self, lo: int) -> list[Segment]:
        """The tokens from absolute position ``lo`` on, oldest first, as they are held."""
        end = self.committed_end
        segments = self.committed.segments(lo, end)
        pk, pv = self.pending.joined()
        if pk is not None and pv is not None:
            skip = max(0, lo - end)
            segments.append(((pk[:, :, skip:],), (pv[:, :, skip:],), FULL, FULL))
        return segments

    def _visible(self, lo: int, dtype: mx.Dtype, rotated: bool) -> tuple[mx.array, mx.array, bool, bool]:
        """Positions ``[lo, offset)`` of the working copy (``WorkingCopy.visible``)."""
        return self.work.visible(lo, self.offset, dtype, rotated, self._segments, self.pending.n)

    def _decoded(self, lo: int, dtype: mx.Dtype, krot: bool, vrot: bool) -> tuple[mx.array, mx.array]:
        """Positions ``[lo, offset)`` as held, at full precision (in the rotated space where
        ``krot`` / ``vrot``)."""
        return decode_segments(self._segments(lo), self.offset - lo, dtype, krot, vrot)

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
                queries, self._segments(lo), scale, self.offset - L, lo, self.spec.window, sinks,
                full_body=self.quant.keys.bits is None,
            )  # fmt: skip
        q = queries @ rotation(queries.shape[-1]) if f.krot else queries
        n_keys = f.k.shape[2]
        mask = positional_mask(
            self.offset - L, L, self.offset - n_keys, self.spec.window, False, self.spec.chunk
        )
        out = attention(q, f.k, f.v, scale, mask, sinks)
        return out @ rotation(out.shape[-1]).T if f.vrot else out

    def fetched_copy(self) -> tuple[object, int, bool, bool, mx.array, mx.array, mx.array, mx.array] | None:
        """What the last ``update_and_fetch`` returned where it is the whole working copy:
        the decode its first rows are (``Working.decoded_from``), how many rows, whether K
        and V are in the codec's rotated space, the prefix rows' keys and values and the
        rest's (``WorkingCopy.split_rows``). None otherwise (a window, served from the
        stored form, no shared decode)."""
        f, w = self._fetched, self.work.buf
        if f is None or w is None or w.decoded_from is None or self.serve_stored:
            return None
        if f.k.shape[2] != self.offset - w.start:
            return None
        return w.decoded_from, w.decoded_rows, f.krot, f.vrot, *self.work.split_rows()

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
        k, v = self.pending.joined()
        if k is None or v is None:
            return
        self.work.unshare()
        first = self.committed_end
        self.committed.add(k, v, first)
        self.pending.set(None, None)
        self._fetched = None
        w = self.work.buf
        if not keep_work or w is None or w.end != self.offset:
            self.work.buf = None  # the request is over: only the stored form stays in memory
            return
        # A sliding layer's copy may start after this request's first rows (``append`` let
        # them go): a later request that needs them rebuilds from the stored form.
        self.work.refresh(max(first, keep_from), self.offset, self._segments)

    def drop_before(self, position: int) -> None:
        """Free committed tokens before ``position`` (sliding layers past their window)."""
        cut = min(position, self.committed_end)
        c = self.committed
        if cut <= c.start or cut < c.body_start:
            return  # nothing to free, or only part of the (few) head tokens
        self.work.drop_before(cut)
        c.drop_before(cut, self.committed_end)

    def trim_to(self, n_tokens: int) -> None:
        """Keep positions < ``n_tokens`` (committed tokens only; ``start <= n_tokens``)."""
        if self.pending.n:
            raise RuntimeError("trim_to with pending tokens: commit first (this is a bug)")
        self.work.trim_to(n_tokens)
        if n_tokens < self.committed.start:
            raise RuntimeError("cannot trim below the first token in memory; rebuild from blocks")
        self.committed.trim_to(n_tokens)
        self.offset = n_tokens

    # ---------------------------------------------------------------- blocks

    def block_state(self, index: int, a: int, b: int) -> dict[str, mx.array]:
        """This layer's stored K/V of positions ``[a, b)`` as block tensors, named
        ``L{index}.{k|v}.{part}`` (``block_tensors``): what a block file holds for this layer."""
        return block_tensors(index, self.committed.quant, *self.committed_slice(a, b))

    def body_buffers(self, index: int, a: int, b: int) -> tuple[dict[str, mx.array], int, int] | None:
        """The committed body's whole buffers, named as layer ``index``'s block tensors, and
        the rows positions ``[a, b)`` are in them; None unless all of them are body. Blocks
        cut from these are views (``block_cuts.run_of``): no copy of a turn's new rows is
        made for its save, where ``block_state`` copies them."""
        c = self.committed
        if c.kbuf is None or c.vbuf is None or a < c.body_start or b > self.committed_end:
            return None
        buffers = {
            tensor_name(index, kv, part): x
            for kv, codec, parts in (("k", c.quant.keys, c.kbuf), ("v", c.quant.values, c.vbuf))
            for part, x in zip(codec.parts(), parts, strict=True)
        }
        return buffers, a - c.body_start, b - c.body_start

    def from_blocks(self, index: int, start: int, blocks: list[dict[str, mx.array]], held: int) -> None:
        """Load this layer (layer ``index``) from consecutive blocks' tensors, the first of
        which starts at position ``start``; together they stand for ``held`` tokens
        (``stored_of_blocks``). ``KeyError`` names a tensor a block lacks; ``ValueError`` if
        they do not add up."""
        self.load(start, *stored_of_blocks(index, self.committed.quant, start, blocks))
        if self.offset != start + held:
            raise ValueError(
                f"layer {index}: blocks hold {self.offset - start} tokens of K/V for {held} token ids"
            )

    def committed_slice(self, a: int, b: int) -> tuple[Pair | None, tuple[Parts, Parts] | None]:
        """Stored (head K, V) and (body K parts, V parts) of absolute positions [a, b)
        (committed and in memory); either is None where the range has none of it."""
        start, end = self.committed.start, self.committed_end
        if not (start <= a <= b <= end):
            raise RuntimeError(f"positions [{a}, {b}) not committed in memory [{start}, {end})")
        return self.committed.slice(a, b)

    def load(self, start: int, head: Pair | None, keys: Parts | None, values: Parts | None) -> None:
        """Set committed contents: ``head`` (only with ``start == 0``) then the body, in
        stored form, from absolute position ``start``."""
        self.committed.load(start, head, keys, values)
        self.offset = self.committed.body_start + self.committed.n_body
        self.pending.set(None, None)
        self.work.buf = None
        self.work.unshare()
        self._fetched = None


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
