"""The model runner: prefill chunks, batched decode steps, sampling.

A decode batch keeps its layer caches from step to step (merged buffers grow in place);
a request that finishes leaves by ``filter`` and one that starts decoding joins by
``extend``, as in mlx-lm's ``BatchGenerator``. Sampling draws from an explicit RNG key
per request and step: the same seed gives the same text however requests interleave, and
mlx's global RNG is never touched.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from ..kv import BatchLayerCache, LayerCache, RecurrentCache, batch_layer_caches
from ..model.constrain import TokenConstraint
from ..model.forward import decode_step, forward_of, prefill_chunk
from ..ops import device
from ..ops.runtime import mx
from ..storage.blocks import BLOCK_TOKENS

logger = logging.getLogger(__name__)

#: A decode batch member: (request key, token to feed, its layer caches).
Member = tuple[Hashable, int | mx.array, list[LayerCache]]


@dataclass(frozen=True, slots=True)
class Penalties:
    """Penalties against repeating tokens, as mlx-lm's ``make_logits_processors`` applies
    them (small models loop without them): ``repetition`` multiplies (> 1 discourages; 1.1
    is typical), ``presence`` and ``frequency`` subtract (OpenAI's), over the last ``window``
    tokens of the context and the reply."""

    repetition: float | None = None
    presence: float | None = None
    frequency: float | None = None
    window: int = 20

    @classmethod
    def of(
        cls, repetition: float | None, presence: float | None, frequency: float | None, window: int = 20
    ) -> Penalties | None:
        if not (repetition or presence or frequency):
            return None
        return cls(repetition or None, presence or None, frequency or None, window)

    def processors(self) -> list[Any]:
        from mlx_lm.sample_utils import make_logits_processors

        return make_logits_processors(
            repetition_penalty=self.repetition, repetition_context_size=self.window,
            presence_penalty=self.presence, presence_context_size=self.window,
            frequency_penalty=self.frequency, frequency_context_size=self.window,
        )  # fmt: skip


class Sampler:
    """One request's token choice: greedy at temperature 0, else categorical (after top-k,
    min-p and top-p, as mlx-lm's sampler orders them) with the key of (seed, step); a
    grammar constraint masks the logits first."""

    def __init__(
        self,
        temperature: float,
        top_p: float,
        seed: int | None,
        constraint: TokenConstraint | None,
        top_k: int = 0,
        min_p: float = 0.0,
        penalties: Penalties | None = None,
        context: Sequence[int] = (),
    ) -> None:
        self.temperature, self.top_p, self.constraint = temperature, top_p, constraint
        self.top_k, self.min_p = top_k, min_p
        self.seed = seed if seed is not None else secrets.randbits(62)
        #: mlx-lm's logits processors for the penalties (none: no penalty), over the last
        #: tokens of the context and the reply so far (``context`` then each draw).
        self.processors = penalties.processors() if penalties is not None else []
        self._window = penalties.window if penalties is not None else 0
        self._history: list[int | mx.array] = list(context[-self._window :]) if self._window else []

    @property
    def greedy(self) -> bool:
        """Whether the choice is one argmax, batched with others (no grammar, no penalty)."""
        return self.temperature == 0 and self.constraint is None and not self.processors

    def __call__(self, logits: mx.array, step: int) -> int:
        logits = self._penalised(logits)
        if self.constraint is not None:
            logits = self.constraint.mask(logits)
        token = int(self._draw(logits, step).item())
        if self.constraint is not None:
            self.constraint.advance(token)
        self._remember(token)
        return token

    def lazy(self, logits: mx.array, step: int) -> mx.array | None:
        """The token of ``step`` as a lazy array (the same choice as calling the sampler), so
        the next step's graph can be built before it is known; None where the choice needs
        the host first (a grammar masks by the text so far)."""
        if self.constraint is not None:
            return None
        token = self._draw(self._penalised(logits), step)
        self._remember(token)
        return token

    def _penalised(self, logits: mx.array) -> mx.array:
        if not self.processors or not self._history:
            return logits
        tokens = mx.stack([t.reshape(()) if isinstance(t, mx.array) else mx.array(t) for t in self._history])
        rows = logits[None]
        for process in self.processors:
            rows = process(tokens.astype(mx.int32), rows)
        return rows[0]

    def _remember(self, token: int | mx.array) -> None:
        if self.processors:
            # The processors read the last ``window`` tokens only: older ones would be
            # stacked into every step's graph for nothing (a long reply grew it each step).
            self._history = [*self._history[-(self._window - 1) :], token] if self._window > 1 else [token]

    def _draw(self, logits: mx.array, step: int) -> mx.array:
        if self.temperature == 0:
            return mx.argmax(logits)
        from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        if 0 < self.top_k < logprobs.shape[-1]:
            logprobs = apply_top_k(logprobs[None], self.top_k)[0]
        if self.min_p > 0.0:
            logprobs = apply_min_p(logprobs[None], self.min_p)[0]
        if self.top_p < 1.0:
            logprobs = apply_top_p(logprobs[None], self.top_p)[0]
        key = mx.random.key(self.seed + step)
        return mx.random.categorical(logprobs * (1 / self.temperature), key=key)


class ModelRunner:
    """Runs one model for the engine's requests (on the worker thread)."""

    def __init__(self, model: Any, batches: bool = True) -> None:
        self.model = model
        #: Several requests' steps in one forward pass; False: one at a time (a model whose
        #: attention cannot take the batch's mask: ``self_check.batch_agrees``).
        self.batches = batches
        self._members: list[Hashable] = []  # the decode batch, in row order
        self._caches: list[BatchLayerCache] | None = None
        self._cache_bound = device.prefill_cache_bound()
        self._merge = device.merged_batch()

    def prefill(self, ids: list[int], layers: list[LayerCache], last: bool) -> mx.array | None:
        """One prefill chunk; the last position's logits if it is the ``last`` chunk. With
        recurrent layers the chunk is run in pieces that end on block boundaries, each
        boundary's state snapshotted (``RecurrentCache.snapshot``): the only points, besides
        the end of a turn, a later request can resume from."""
        recurrent = [c for c in layers if isinstance(c, RecurrentCache)]
        logits = None
        at, n = 0, len(ids)
        while at < n:
            offset = layers[0].offset
            piece = n - at
            if recurrent:
                piece = min(piece, BLOCK_TOKENS - offset % BLOCK_TOKENS)
            end = at + piece
            logits = prefill_chunk(self.model, ids[at:end], layers, last=last and end == n)
            at = end
            # Block boundaries, and the prompt's end (a request that sends the same prompt
            # again, for another reply, resumes there).
            if recurrent and (layers[0].offset % BLOCK_TOKENS == 0 or (last and end == n)):
                for c in recurrent:
                    c.snapshot()
        if self._cache_bound is not None and mx.get_cache_memory() > self._cache_bound:
            mx.clear_cache()  # buffers of sizes the next chunks will not ask for (``device``)
        return logits

    def prefill_whole(self, items: list[tuple[list[int], list[LayerCache]]]) -> mx.array:
        """Several requests' whole prefills (token ids, their layer caches) in one batched
        forward pass: the logits (float32) of each one's last token, in the order given.

        The shorter ones are padded on the right: a causal query never sees a later
        position, so their real tokens compute what they would alone, and the padding's
        keys and values are taken out of their caches after the pass (``unfeed``). Each
        member attends over its own caches (no merged buffer: built for one pass, it would
        be a copy of every member's keys for nothing)."""
        if len(items) == 1 or not self.batches or any(isinstance(c, RecurrentCache) for c in items[0][1]):
            # Recurrent layers cannot take right padding back out (``unfeed``): one by one.
            rows = [self.prefill(ids, layers, last=True) for ids, layers in items]
            return mx.stack(rows)  # type: ignore[arg-type]
        width = max(len(ids) for ids, _ in items)
        tokens = mx.array([ids + [ids[-1]] * (width - len(ids)) for ids, _ in items])
        caches = batch_layer_caches(
            [layers for _, layers in items], merge=False, merge_stored=False, merge_prefix=False
        )
        lasts = mx.array([len(ids) - 1 for ids, _ in items])
        logits = forward_of(self.model)(tokens, caches, lasts)[:, -1].astype(mx.float32)
        mx.eval(logits)
        if self._cache_bound is not None and mx.get_cache_memory() > self._cache_bound:
            mx.clear_cache()  # as after a prefill chunk (``device.prefill_cache_bound``)
        for ids, layers in items:
            if len(ids) < width:
                for layer in layers:
                    layer.unfeed(width - len(ids))
        return logits

    def decode(self, members: list[Member]) -> mx.array:
        """One decode step for each (request key, token to feed, its layer caches): the
        logits rows (float32), in the order given. A token may be a lazy array (the last
        step's draw, not yet evaluated). One member decodes alone; several as one batched
        forward pass over the batch kept from the previous step."""
        if len(members) == 1 or not self.batches:
            self.leave_all()
            return mx.stack([decode_step(self.model, token, layers) for _, token, layers in members])
        caches = self._batch_for(members)
        order = {key: row for row, key in enumerate(self._members)}
        rows = [order[key] for key, _, _ in members]
        by_row: list[mx.array] = [mx.array(0)] * len(rows)
        for (_, token, _), row in zip(members, rows, strict=True):
            by_row[row] = token if isinstance(token, mx.array) else mx.array(token)
        tokens = mx.stack([t.reshape(()).astype(mx.int32) for t in by_row])[:, None]
        out = forward_of(self.model)(tokens, caches, None)[:, -1].astype(mx.float32)
        return out if rows == list(range(len(rows))) else out[mx.array(rows)]

    def _batch_for(self, members: list[Member]) -> list[BatchLayerCache]:
        keys = [key for key, _, _ in members]
        if self._caches is None:
            self._members = keys
            self._caches = batch_layer_caches([layers for _, _, layers in members], self._merge)
            return self._caches
        wanted = set(keys)
        keep = [i for i, key in enumerate(self._members) if key in wanted]
        if len(keep) != len(self._members):
            for c in self._caches:
                c.filter(keep)
            self._members = [self._members[i] for i in keep]
        present = set(self._members)
        joining = [(key, layers) for key, _, layers in members if key not in present]
        if joining:
            per_layer = list(zip(*(layers for _, layers in joining), strict=True))
            for c, new in zip(self._caches, per_layer, strict=True):
                c.extend(list(new))
            self._members += [key for key, _ in joining]
        offsets = mx.array([c.offset for c in self._caches[0].caches])
        return [c.step(offsets) for c in self._caches]

    def warm_up(self, new_layers: Callable[[], list[LayerCache]], tokenizer: Any) -> None:
        """Run, with throwaway caches, the shapes of a first turn: a prefill chunk, its
        commit (the format's encoding), a short new turn over the stored form, and decode
        steps alone and batched; so that mlx compiles their kernels now (its CUDA build
        compiles each kernel on first use: about 0.4 s of a new process's first warm 32K
        turn on the H100) instead of while a request waits. A failure is logged: only a
        first request's speed depends on it."""
        try:
            ids = tokenizer.encode("An agent's first turn compiles nothing: this one did. " * 30)[:320]
            self._warm_up(new_layers, ids)
        except Exception:
            logger.warning(
                "the kernel warm-up at engine start failed (first requests compile)", exc_info=True
            )

    def _warm_up(self, new_layers: Callable[[], list[LayerCache]], ids: list[int]) -> None:
        agents = [new_layers() for _ in range(3)]
        for layers in agents:
            self.prefill(ids, layers, last=True)
            for c in layers:
                c.commit()
            mx.eval(self.prefill(ids[:15], layers, last=True))

        def step(n: int) -> None:
            mx.eval(self.decode([(f"warm-up {i}", ids[i + 1], agents[i]) for i in range(n)]))

        # Alone; a batch forms, then steps; a member joins it; one leaves it (the others'
        # rows kept: ``StoredBatch.filter``). A second turn of 4 agents on the H100 spent
        # 4.5 s in its first such leave (benchmarks/README, 12-07), after a warm-up that
        # dissolved its batch and never filtered one.
        for n in (1, 2, 2, 3, 3):
            step(n)
        self.leave("warm-up 2")
        step(2)
        self.leave_all()
        mx.clear_cache()

    def in_batch(self, key: Hashable) -> bool:
        """Whether ``key``'s caches are merged into the decode batch right now."""
        return self._caches is not None and key in self._members

    def leave(self, *keys: Hashable) -> None:
        """Requests stop decoding: their rows go back to their own layer caches, in one copy
        of the batch however many leave."""
        if self._caches is None:
            return
        gone = set(keys)
        keep = [i for i, k in enumerate(self._members) if k not in gone]
        if len(keep) == len(self._members):
            return
        if len(keep) < 2:
            return self.leave_all()
        for c in self._caches:
            c.filter(keep)
        self._members = [self._members[i] for i in keep]

    def leave_all(self) -> None:
        if self._caches is not None:
            for c in self._caches:
                c.dissolve()
        self._caches, self._members = None, []
