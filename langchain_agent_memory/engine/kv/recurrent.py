"""A hybrid model's recurrent layers (linear attention, state-space): one agent's state, and
the snapshots of it that let a request resume from a point before the end.

A recurrent layer keeps a fixed-size state (mlx-lm's ``ArraysCache``: a convolution window
and a delta-rule or SSM matrix) instead of keys and values, and a state cannot be cut back:
the state after token ``t`` exists only where a forward pass ended at ``t``. So the engine
ends prefill chunks on block boundaries, takes a snapshot there (``snapshot``), and stores
the snapshots a policy keeps (``engine.states``) beside the attention layers' blocks; a
request resumes from the newest snapshot at or before the point where its prompt parts
from the stored text, and prefills the rest.

``RecurrentCache`` is an ``ArraysCache`` (Mamba's layers write their state only into one)
with what mlx-lm's recurrent layers use of it overridden (``cache[i]`` read and written,
``lengths`` / ``left_padding`` / ``advance`` / ``make_mask`` for batched prompts), and
the part of the engine's layer protocol that a layer without keys and values has:
``offset``, ``trim_to`` (to a snapshot), ``unfeed`` (one step back: the decode that runs
one step ahead), no blocks of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from mlx_lm.models.cache import ArraysCache

from ..ops.runtime import mx
from .spec import LayerSpec

#: One snapshot: the layer's state arrays, in ``ArraysCache`` order.
State = tuple[mx.array, ...]


class RecurrentCache(ArraysCache):  # type: ignore[misc]
    """One recurrent layer of one agent: its state after ``offset`` tokens, and snapshots
    of it at earlier positions (``snapshots``, this request's, until its commit)."""

    def __init__(self, spec: LayerSpec) -> None:
        assert spec.state is not None
        self.spec = spec
        self.cache: list[mx.array | None] = [None] * len(spec.state)
        self.lengths: mx.array | None = None
        self.left_padding: mx.array | None = None
        self.start = 0  # the state stands for every token before ``offset``
        self.offset = 0
        #: position -> the state there (block boundaries this request passed).
        self.snapshots: dict[int, State] = {}
        # The state before the last forward pass, for ``unfeed``: (its position, arrays).
        self._before: tuple[int, list[mx.array | None]] | None = None
        self._prior: list[mx.array | None] | None = None  # entries replaced in this pass

    # ------------------------------------------------------------ mlx-lm's protocol

    def __getitem__(self, i: int) -> mx.array | None:
        return self.cache[i]

    def __setitem__(self, i: int, value: mx.array) -> None:
        if self._prior is None:
            self._prior = list(self.cache)
        self.cache[i] = value

    def advance(self, n: int) -> None:
        if self.lengths is not None:
            self.lengths = self.lengths - n
        if self.left_padding is not None:
            self.left_padding = self.left_padding - n

    def make_mask(self, N: int) -> mx.array | None:
        pos = mx.arange(N)
        mask = None
        if self.left_padding is not None:
            mask = pos >= self.left_padding[:, None]
        if self.lengths is not None:
            in_length = pos < self.lengths[:, None]
            mask = in_length if mask is None else (mask & in_length)
        return mask

    def empty(self) -> bool:
        return self.cache[0] is None

    @property
    def state(self) -> list[mx.array]:
        return [x for x in self.cache if x is not None]

    @property
    def nbytes(self) -> int:
        held = sum(x.nbytes for x in self.state)
        return held + sum(x.nbytes for snap in self.snapshots.values() for x in snap)

    # ------------------------------------------------------------ the engine's side

    def fed(self, n: int) -> None:
        """A forward pass of ``n`` tokens went through this layer (the runner says so:
        mlx-lm's layers count nothing themselves)."""
        if self._prior is not None:
            self._before = (self.offset, self._prior)
            self._prior = None
        self.offset += n

    def snapshot(self) -> None:
        """Keep the state as it is now (at ``offset``) for this request's commit."""
        now = self.current()
        if now is not None:
            self.snapshots[self.offset] = now

    def current(self) -> State | None:
        """The state at ``offset`` (None before the first token)."""
        return None if self.empty() else tuple(x for x in self.cache if x is not None)

    def held(self) -> dict[int, State]:
        """Every state held, by position: the snapshots, the one before the last step, the
        current one."""
        out = dict(self.snapshots)
        if self._before is not None and self._before[0] and all(x is not None for x in self._before[1]):
            out[self._before[0]] = tuple(x for x in self._before[1] if x is not None)
        now = self.current()
        if now is not None:
            out[self.offset] = now
        return out

    def state_at(self, position: int) -> State | None:
        """The state after ``position`` tokens, if held (``held``)."""
        return self.held().get(position)

    def can_trim(self, n_tokens: int) -> bool:
        return n_tokens == self.offset or n_tokens in self.held()

    def trim_to(self, n_tokens: int) -> None:
        """Go back to the state after ``n_tokens`` (one held: ``can_trim``)."""
        if n_tokens == self.offset:
            return
        if n_tokens in self.snapshots:
            self.load(n_tokens, self.snapshots[n_tokens])
        elif self._before is not None and self._before[0] == n_tokens:
            self.cache, self.offset = list(self._before[1]), n_tokens
        else:
            raise RuntimeError(
                f"a recurrent layer holds no state at {n_tokens} tokens (it is at {self.offset}); "
                "this is a bug: resume points come from its snapshots"
            )
        self._before = self._prior = None
        self.snapshots = {p: s for p, s in self.snapshots.items() if p <= n_tokens}

    def unfeed(self, n: int) -> None:
        """Take back the last ``n`` tokens fed (the last decode step's: ``n`` is 1)."""
        self.trim_to(self.offset - n)

    def load(self, position: int, state: State | None) -> None:
        """Stand for the first ``position`` tokens, with ``state`` (None: position 0)."""
        if (state is None) != (position == 0):
            raise ValueError(f"a recurrent layer's state at {position} tokens must be given (and only then)")
        self.cache = list(state) if state is not None else [None] * len(self.cache)
        self.offset = position
        self._before = self._prior = None

    def commit(self, keep_work: bool = False, keep_from: int = 0) -> None:
        """The request ended: what it snapshotted has been taken (``engine.states``)."""
        self.snapshots.clear()
        self._before = self._prior = None

    @property
    def committed_end(self) -> int:
        return self.offset

    def drop_before(self, position: int) -> None:
        pass  # a state holds no positions to drop

    @property
    def work_nbytes(self) -> int:
        return 0

    def drop_work(self) -> None:
        pass

    def block_state(self, index: int, a: int, b: int) -> dict[str, mx.array]:
        return {}  # no keys and values: its snapshots are blocks of their own

    def is_trimmable(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"RecurrentCache(offset={self.offset}, snapshots={sorted(self.snapshots)})"


def state_tensors(index: int, state: State) -> dict[str, mx.array]:
    """Layer ``index``'s state as block tensors ``L{index}.s{j}``, each flattened to
    (1, 1, 1, size): a block file holds (batch, heads, tokens, width) tensors (the layer's
    spec has the shapes)."""
    return {f"L{index}.s{j}": x.reshape(1, 1, 1, -1) for j, x in enumerate(state)}


def state_from_tensors(index: int, spec: LayerSpec, tensors: Any) -> State:
    """Layer ``index``'s state from a snapshot block's tensors (``KeyError`` names one it lacks;
    ``ValueError`` if a shape is not the layer's)."""
    assert spec.state is not None
    out = []
    for j, (shape, dtype) in enumerate(spec.state):
        x = tensors[f"L{index}.s{j}"]
        if x.size != int(np.prod(shape)):
            raise ValueError(f"layer {index}: a state snapshot of {x.size} values does not fill {shape}")
        x = x.reshape(1, *shape)
        out.append(x if x.dtype == getattr(mx, dtype) else x.astype(getattr(mx, dtype)))
    return tuple(out)


class BatchRecurrentCache(ArraysCache):  # type: ignore[misc]
    """One recurrent layer of several agents, stepped together (a decode step: one token
    each, no padding): each entry read as the members' rows stacked, written back as each
    member's row, so every member's own cache is current after every step (it can leave,
    commit or ``unfeed`` with nothing to hand back)."""

    def __init__(self, caches: list[RecurrentCache], offsets: mx.array) -> None:
        self.caches = list(caches)
        self.offset = offsets
        self.lengths: mx.array | None = None
        self.left_padding: mx.array | None = None

    def step(self, offsets: mx.array) -> BatchRecurrentCache:
        self.offset = offsets
        return self

    def __getitem__(self, i: int) -> mx.array | None:
        rows = [c.cache[i] for c in self.caches]
        if any(r is None for r in rows):
            if all(r is None for r in rows):
                return None
            raise RuntimeError(
                "a decode batch mixes recurrent layers with and without a state (this is a bug)"
            )
        return mx.concatenate(rows, axis=0)  # type: ignore[arg-type]

    def __setitem__(self, i: int, value: mx.array) -> None:
        for row, c in enumerate(self.caches):
            c[i] = value[row : row + 1]

    def advance(self, n: int) -> None:
        pass  # no lengths or padding in a decode step

    def make_mask(self, N: int) -> mx.array | None:
        return None

    def fed(self, n: int) -> None:
        for c in self.caches:
            c.fed(n)

    def filter(self, keep: list[int]) -> None:
        self.caches = [self.caches[i] for i in keep]

    def extend(self, caches: list[RecurrentCache]) -> None:
        self.caches += caches

    def dissolve(self) -> None:
        self.caches = []

    @property
    def state(self) -> list[Any]:
        return [c.state for c in self.caches]


def fed(caches: Any, n: int) -> None:
    """Tell the recurrent layers among ``caches`` that a pass of ``n`` tokens ran."""
    for c in caches:
        if isinstance(c, (RecurrentCache, BatchRecurrentCache)):
            c.fed(n)


def states_of(tensors: Any, specs: Sequence[LayerSpec]) -> list[State | None]:
    """Each layer's state from a snapshot block's tensors (None for attention layers);
    ``KeyError`` or ``ValueError`` if it is not one of this model's."""
    return [state_from_tensors(i, s, tensors) if s.recurrent else None for i, s in enumerate(specs)]
