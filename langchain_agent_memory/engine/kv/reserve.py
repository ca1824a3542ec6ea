"""Working-copy memory a CPU engine touches once when it starts, as llama.cpp's context
allocates and clears its KV buffer before any state is loaded into it.

Why: a warm restore decodes every layer's stored K/V into full-precision working copies
(``layer_work.decode_segments``), and in a new process all of that memory is fresh. On the 2-core
Zen 5 VM the first touch of a page costs ~1.6 us: a SmolLM2 agent of 8K tokens has 436 MB
of float32 working copies, ~0.15 s of page faults in a warm restore of ~0.65 s (30 layers
decoded into fresh buffers: 0.30-0.37 s; into touched ones: 0.14-0.15 s).

How, without touching mlx: MLX's CPU allocator keeps freed buffers in a cache (32 MB by
default) and hands one back to a request of the same size (within two pages). The engine
raises that limit by the reserve, makes one K and one V buffer per layer of the size a
working copy of an agent at the engine's context length has (``rows``), evaluates them
(which writes every page) and drops them: they wait in the cache. A working copy then takes
that size when it fits in it with at most half of it spare (``WorkingCopy.rows``), and
its buffer comes back from the cache already touched; a copy dropped later goes back to it
for the next agent. Capped at the work budget: a context too long for it reserves the
longest agent that fits.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..ops.runtime import mx
from .buffers import grown_rows
from .spec import ModelCacheSpec

#: Far above any memory: raising the cache limit to it never frees a cached buffer, and the
#: previous limit comes back with it (mlx has no getter).
_UNLIMITED = 1 << 62
#: Fewer rows than this for full-attention layers: not worth reserving.
_MIN_ROWS = 1024


def reserve_rows(
    spec: ModelCacheSpec, context_length: int, chunk_tokens: int, budget_bytes: int
) -> tuple[int, ...]:
    """Per layer, the working-copy rows to reserve (0: none): an agent of ``context_length``
    tokens for full-attention layers, a window and a prefill chunk for sliding ones; full
    layers cut to what ``budget_bytes`` holds."""
    cap = grown_rows(context_length)
    sliding = [
        0 if s.window is None else min(cap, grown_rows(s.window - 1 + chunk_tokens)) for s in spec.layers
    ]
    full_row = reserve_bytes(spec, [1 if s.window is None else 0 for s in spec.layers])
    room = budget_bytes - reserve_bytes(spec, sliding)
    if room <= 0:
        return tuple(0 for _ in spec.layers)
    full = min(cap, room // full_row // 256 * 256) if full_row else 0
    if full < _MIN_ROWS:
        full = 0
    return tuple(full if s.window is None else r for s, r in zip(spec.layers, sliding, strict=True))


def reserve_bytes(spec: ModelCacheSpec, rows: Sequence[int]) -> int:
    """Bytes of one K and one V working-copy buffer of ``rows[i]`` rows for each layer i."""
    itemsize = getattr(mx, spec.dtype).size
    per_row = [s.kv_heads * (s.k_head_dim + s.v_head_dim) * itemsize for s in spec.layers]
    return sum(r * b for r, b in zip(rows, per_row, strict=True))


class WorkReserve:
    """The touched buffers of ``reserve_rows`` waiting in MLX's CPU buffer cache (see the
    module's docstring); ``release`` gives the cache limit back."""

    def __init__(self, spec: ModelCacheSpec, rows: tuple[int, ...]) -> None:
        self.nbytes = reserve_bytes(spec, rows)
        self._raised = False
        if not self.nbytes:
            return
        previous = mx.set_cache_limit(_UNLIMITED)
        mx.set_cache_limit(min(previous, _UNLIMITED - self.nbytes) + self.nbytes)
        self._raised = True
        dtype = getattr(mx, spec.dtype)
        buffers = [
            mx.zeros((1, s.kv_heads, r, d), dtype)
            for s, r in zip(spec.layers, rows, strict=True)
            if r
            for d in (s.k_head_dim, s.v_head_dim)
        ]
        mx.eval(buffers)  # every page written once
        del buffers  # into the cache, where working copies of these sizes take them from

    def release(self) -> None:
        """Lower the cache limit again (the cache frees what no longer fits, oldest first)."""
        if self._raised:
            current = mx.set_cache_limit(_UNLIMITED)
            mx.set_cache_limit(max(0, current - self.nbytes))
            self._raised = False
