"""The block side of ``LayerCache`` (it inherits ``LayerBlocks``): a layer's committed tokens
as block tensors (``block_state``), loaded back from them (``from_blocks``, ``load``), and
slices of what is committed (``committed_slice``)."""

from __future__ import annotations

from typing import Any

from ..ops.runtime import mx
from .buffers import slice_parts
from .codecs import KVQuant
from .stored import Parts

#: Tensor-name part of a block's 16-bit first tokens (``KVQuant.head_tokens``, block 0 only).
HEAD_PART = "head"


def tensor_name(layer: int, kv: str, part: str) -> str:
    """A block tensor's name: ``L{layer}.{k|v}`` (16-bit) or ``L{layer}.{k|v}.{part}``."""
    return f"L{layer}.{kv}.{part}" if part else f"L{layer}.{kv}"


class LayerBlocks:
    """A layer's committed tokens to and from blocks (its attributes are the layer's)."""

    quant: KVQuant
    start: int
    offset: int
    head_k: mx.array | None
    head_v: mx.array | None
    _n_body: int
    _work: Any
    _fetched: Any

    def block_state(self, index: int, a: int, b: int) -> dict[str, mx.array]:
        """This layer's stored K/V of positions ``[a, b)`` as block tensors, named
        ``L{index}.{k|v}.{part}`` (``part``: the codec's, or ``head`` for the 16-bit first
        tokens): what a block file holds for this layer."""
        head, body = self.committed_slice(a, b)
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
            for kv, codec, parts in (("k", self.quant.keys, body[0]), ("v", self.quant.values, body[1])):
                for part, arr in zip(codec.parts(), parts, strict=True):
                    tensors[tensor_name(index, kv, part)] = arr
        return tensors

    def from_blocks(self, index: int, start: int, blocks: list[dict[str, mx.array]], held: int) -> None:
        """Load this layer (layer ``index``) from consecutive blocks' tensors, the first of
        which starts at position ``start``; together they stand for ``held`` tokens. A block
        without this layer's tensors (a sliding layer's block past its window) holds none of
        them. ``KeyError`` names a tensor a block lacks; ``ValueError`` if they do not add up."""
        kparts, vparts = self.quant.keys.parts(), self.quant.values.parts()
        head = None
        if start == 0 and blocks and tensor_name(index, "k", HEAD_PART) in blocks[0]:
            head = (
                blocks[0][tensor_name(index, "k", HEAD_PART)],
                blocks[0][tensor_name(index, "v", HEAD_PART)],
            )
        body = [blk for blk in blocks if tensor_name(index, "k", kparts[0]) in blk]
        k = v = None
        if body:
            k = tuple(
                mx.concatenate([blk[tensor_name(index, "k", p)] for blk in body], axis=2) for p in kparts
            )
            v = tuple(
                mx.concatenate([blk[tensor_name(index, "v", p)] for blk in body], axis=2) for p in vparts
            )
        self.load(start, head, k, v)
        if self.offset != start + held:
            raise ValueError(
                f"layer {index}: blocks hold {self.offset - start} tokens of K/V for {held} token ids"
            )

    def committed_slice(
        self, a: int, b: int
    ) -> tuple[tuple[mx.array, mx.array] | None, tuple[Parts, Parts] | None]:
        """Stored (head K, V) and (body K parts, V parts) of absolute positions [a, b)
        (committed and in memory); either is None where the range has none of it."""
        if not (self.start <= a <= b <= self.committed_end):
            raise RuntimeError(
                f"positions [{a}, {b}) not committed in memory [{self.start}, {self.committed_end})"
            )
        head = body = None
        if self.head_k is not None and self.head_v is not None and a < self.n_head:
            z = min(b, self.n_head)
            head = (self.head_k[:, :, a:z], self.head_v[:, :, a:z])
        b0 = self.body_start
        if self.keys is not None and self.values is not None and max(a, b0) < b:
            lo, hi = max(a, b0) - b0, b - b0
            body = (slice_parts(self.keys, lo, hi), slice_parts(self.values, lo, hi))
        return head, body

    def load(
        self,
        start: int,
        head: tuple[mx.array, mx.array] | None,
        keys: Parts | None,
        values: Parts | None,
    ) -> None:
        """Set committed contents: ``head`` (only with ``start == 0``) then the body, in
        stored form, from absolute position ``start``."""
        if head is not None and start != 0:
            raise ValueError("head tokens are positions 0.. and need start == 0")
        self.start = start
        self.head_k, self.head_v = head if head is not None else (None, None)
        self._set_body(keys, values)
        self.offset = self.body_start + self._n_body
        self.set_pending(None, None)
        self._work = None
        self._fetched = None
