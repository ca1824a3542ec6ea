"""A layer's committed tokens in stored form (``CommittedKV``, held by ``LayerCache``), and
their block tensors: what a block file holds for a layer (``block_tensors``) and the stored
form read back from them (``stored_of_blocks``)."""

from __future__ import annotations

from ..ops.runtime import mx
from .buffers import grown_rows, slice_parts, with_room
from .codecs import FULL, HALF_DTYPE, KVQuant
from .stored import Parts, Segment

#: Tensor-name part of a block's 16-bit first tokens (``KVQuant.head_tokens``, block 0 only).
HEAD_PART = "head"

Pair = tuple[mx.array, mx.array]


def tensor_name(layer: int, kv: str, part: str) -> str:
    """A block tensor's name: ``L{layer}.{k|v}`` (16-bit) or ``L{layer}.{k|v}.{part}``."""
    return f"L{layer}.{kv}.{part}" if part else f"L{layer}.{kv}"


class CommittedKV:
    """One layer's committed tokens, positions ``[start, body_start + n_body)``:

    - head: positions ``[0, n_head)`` at 16 bits (``KVQuant.head_tokens``; only while
      ``start == 0``),
    - body: positions ``[body_start, ...)`` in the KV format, in buffers with room for appends
      (a commit then writes only its new tokens), their first ``n_body`` positions valid.
    """

    __slots__ = ("head_k", "head_v", "kbuf", "n_body", "quant", "start", "vbuf")

    def __init__(self, quant: KVQuant) -> None:
        self.quant = quant
        self.start = 0  # absolute position of the first token held in memory
        self.head_k: mx.array | None = None  # committed first tokens, 16-bit
        self.head_v: mx.array | None = None
        self.kbuf: Parts | None = None
        self.vbuf: Parts | None = None
        self.n_body = 0

    @property
    def keys(self) -> Parts | None:
        """The body's keys in stored form (views of the buffer)."""
        return self._body_view(self.kbuf)

    @property
    def values(self) -> Parts | None:
        return self._body_view(self.vbuf)

    def _body_view(self, buf: Parts | None) -> Parts | None:
        if buf is None:
            return None
        return buf if buf[0].shape[2] == self.n_body else slice_parts(buf, 0, self.n_body)

    @property
    def n_head(self) -> int:
        return 0 if self.head_k is None else self.head_k.shape[2]

    @property
    def body_start(self) -> int:
        return self.start + self.n_head

    @property
    def nbytes(self) -> int:
        arrays = [*(self.kbuf or ()), *(self.vbuf or ())]
        arrays += [a for a in (self.head_k, self.head_v) if a is not None]
        return sum(int(a.nbytes) for a in arrays)

    def set_body(self, keys: Parts | None, values: Parts | None) -> None:
        self.kbuf, self.vbuf = keys, values
        self.n_body = 0 if keys is None else keys[0].shape[2]

    def append_body(self, keys: Parts, values: Parts) -> None:
        """Add newly encoded tokens to the body, in place while there is room."""
        if self.kbuf is None or self.vbuf is None:
            self.set_body(keys, values)
            return
        n, m = self.n_body, keys[0].shape[2]
        if n + m > self.kbuf[0].shape[2]:
            # A thirty-second more: the body is what a parked agent holds (an eighth of room
            # was an eighth fewer agents in a memory budget), and it grows by whole blocks,
            # once a turn at most; a copy of the stored form costs little on a GPU.
            rows = grown_rows(n + m, share=32)
            self.kbuf = tuple(with_room(x, n, rows) for x in self.kbuf)
            self.vbuf = tuple(with_room(x, n, rows) for x in self.vbuf)
        for buf, new in ((self.kbuf, keys), (self.vbuf, values)):
            for x, y in zip(buf, new, strict=True):
                x[:, :, n : n + m] = y
        self.n_body = n + m

    def add(self, k: mx.array, v: mx.array, first: int) -> None:
        """Commit full-precision tokens of positions ``[first, first + n)``: the first
        ``head_tokens`` positions of a layer held from 0 into the head, the rest encoded."""
        n_head = max(0, min(self.quant.head_tokens, first + k.shape[2]) - first)
        if n_head and self.start == 0 and self.kbuf is None:
            hk, hv = k[:, :, :n_head].astype(HALF_DTYPE), v[:, :, :n_head].astype(HALF_DTYPE)
            self.head_k = hk if self.head_k is None else mx.concatenate([self.head_k, hk], axis=2)
            self.head_v = hv if self.head_v is None else mx.concatenate([self.head_v, hv], axis=2)
            k, v = k[:, :, n_head:], v[:, :, n_head:]
        if k.shape[2]:
            self.append_body(self.quant.keys.encode(k), self.quant.values.encode(v))

    def load(self, start: int, head: Pair | None, keys: Parts | None, values: Parts | None) -> None:
        """Set the contents: ``head`` (only with ``start == 0``) then the body, in stored
        form, from absolute position ``start``."""
        if head is not None and start != 0:
            raise ValueError("head tokens are positions 0.. and need start == 0")
        self.start = start
        self.head_k, self.head_v = head if head is not None else (None, None)
        self.set_body(keys, values)

    def slice(self, a: int, b: int) -> tuple[Pair | None, tuple[Parts, Parts] | None]:
        """Stored (head K, V) and (body K parts, V parts) of absolute positions [a, b) (the
        caller checks that they are held); either is None where the range has none of it."""
        head = body = None
        if self.head_k is not None and self.head_v is not None and a < self.n_head:
            z = min(b, self.n_head)
            head = (self.head_k[:, :, a:z], self.head_v[:, :, a:z])
        b0 = self.body_start
        keys, values = self.keys, self.values
        if keys is not None and values is not None and max(a, b0) < b:
            lo, hi = max(a, b0) - b0, b - b0
            body = (slice_parts(keys, lo, hi), slice_parts(values, lo, hi))
        return head, body

    def segments(self, lo: int, end: int) -> list[Segment]:
        """Positions ``[lo, end)`` as held (head, then body), oldest first."""
        segments: list[Segment] = []
        if self.head_k is not None and self.head_v is not None and lo < self.n_head:
            segments.append(((self.head_k[:, :, lo:],), (self.head_v[:, :, lo:],), FULL, FULL))
        b0 = self.body_start
        keys, values = self.keys, self.values
        if keys is not None and values is not None and max(lo, b0) < end:
            a, b = max(lo, b0) - b0, end - b0
            segments.append(
                (slice_parts(keys, a, b), slice_parts(values, a, b), self.quant.keys, self.quant.values)
            )
        return segments

    def drop_before(self, cut: int, end: int) -> None:
        """Hold positions ``[cut, end)`` only (``cut`` at or past ``body_start``)."""
        b0 = self.body_start
        self.head_k = self.head_v = None
        if self.kbuf is not None and self.vbuf is not None:
            n = end - b0
            self.set_body(slice_parts(self.kbuf, cut - b0, n), slice_parts(self.vbuf, cut - b0, n))
        self.start = cut

    def trim_to(self, n_tokens: int) -> None:
        """Hold positions < ``n_tokens`` only (``start <= n_tokens``)."""
        b0 = self.body_start
        if n_tokens <= b0:
            self.set_body(None, None)
            if self.head_k is not None and self.head_v is not None:
                self.head_k, self.head_v = self.head_k[:, :, :n_tokens], self.head_v[:, :, :n_tokens]
                if n_tokens == 0:
                    self.head_k = self.head_v = None
        elif self.kbuf is not None:
            self.n_body = n_tokens - b0  # later positions: room for the next appends


def block_tensors(
    index: int, quant: KVQuant, head: Pair | None, body: tuple[Parts, Parts] | None
) -> dict[str, mx.array]:
    """Layer ``index``'s stored ``head`` and ``body`` (a ``CommittedKV.slice``) as block
    tensors, named ``L{index}.{k|v}.{part}`` (``part``: the codec's, or ``head`` for the
    16-bit first tokens): what a block file holds for this layer."""
    # Copies (``mx.array``): a view would keep the whole body buffer alive in the block
    # pool, and make the next commit's in-place append copy all of it.
    if head is not None:
        head = (mx.array(head[0]), mx.array(head[1]))
    if body is not None:
        body = (tuple(mx.array(x) for x in body[0]), tuple(mx.array(x) for x in body[1]))
    tensors: dict[str, mx.array] = {}
    if head is not None:
        tensors[tensor_name(index, "k", HEAD_PART)], tensors[tensor_name(index, "v", HEAD_PART)] = head
    if body is not None:
        for kv, codec, parts in (("k", quant.keys, body[0]), ("v", quant.values, body[1])):
            for part, arr in zip(codec.parts(), parts, strict=True):
                tensors[tensor_name(index, kv, part)] = arr
    return tensors


def stored_of_blocks(
    index: int, quant: KVQuant, start: int, blocks: list[dict[str, mx.array]]
) -> tuple[Pair | None, Parts | None, Parts | None]:
    """Layer ``index``'s stored head, body keys and body values in consecutive blocks'
    tensors, the first of which starts at position ``start``. A block without this layer's
    tensors (a sliding layer's block past its window) holds none of them. ``KeyError`` names
    a tensor a block lacks."""
    kparts, vparts = quant.keys.parts(), quant.values.parts()
    head = None
    if start == 0 and blocks and tensor_name(index, "k", HEAD_PART) in blocks[0]:
        head = (
            blocks[0][tensor_name(index, "k", HEAD_PART)],
            blocks[0][tensor_name(index, "v", HEAD_PART)],
        )
    body = [blk for blk in blocks if tensor_name(index, "k", kparts[0]) in blk]
    k = v = None
    if body:
        k = tuple(mx.concatenate([blk[tensor_name(index, "k", p)] for blk in body], axis=2) for p in kparts)
        v = tuple(mx.concatenate([blk[tensor_name(index, "v", p)] for blk in body], axis=2) for p in vparts)
    return head, k, v
