"""Forward passes of an mlx-lm model over the engine's caches, split the way an engine
needs them.

The model runs its own ``__call__``: whatever its head does after the decoder stack
(tied embeddings, Gemma 2's logit soft-capping, Granite's logit scaling, Cohere's logit
scale) is mlx-lm's code, not a copy of it. But mlx-lm's ``model(tokens)`` projects *every*
position onto the vocabulary, and a prefill needs the logits of its last position only:
for Gemma 3 (262K vocabulary, 640 wide) the full projection of a 512-token chunk is 172
GFLOP, more than the rest of the model. So this model instance's decoder stack
(``structure.decoder_stack``) gets a subclass of its own class that cuts its output to the
rows asked for (``adapters.select_stack_rows``) before the head sees it; where no one module runs the
stack, the logits are cut after the model instead (as correct, slower).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..kv.recurrent import fed
from ..ops.runtime import mx
from .adapters import STACK_ROWS, cut_rows, select_stack_rows
from .structure import CacheLayout, decoder_stack, describe

DEFAULT_CHUNK_TOKENS = 512

#: Which rows of the decoder stack's output the head gets: ``LAST`` (each sequence's last
#: position), an array of one position per sequence, or None (every position).
Rows = str | mx.array | None
LAST = "last"


class ModelForward:
    """One loaded model run over the engine's flat list of layer caches (``CacheLayout``
    assembles the model's own list from it: a ``CacheList`` where a layer keeps two)."""

    def __init__(self, model: Any, layout: CacheLayout) -> None:
        self.model = model
        self.layout = layout
        stack = decoder_stack(model)
        if stack is not None:
            select_stack_rows(stack)
        self._cuts_stack = stack is not None

    def __call__(self, tokens: mx.array, caches: Sequence[Any], rows: Rows) -> mx.array:
        """Logits (the model's dtype) of ``tokens`` (batch, length) at ``rows``, appended to
        ``caches`` (the engine's flat list; recurrent layers are told how many tokens ran)."""
        cache = self.layout.assemble(caches)
        try:
            if not self._cuts_stack:
                out = cut_rows(self.model(tokens, cache=cache), rows)
            else:
                reset = STACK_ROWS.set(rows)
                try:
                    out = self.model(tokens, cache=cache)
                finally:
                    STACK_ROWS.reset(reset)
        except BaseException:
            # A pass stopped part-way: what the model's modules wrote during it (Gemma 3n's
            # AltUp reassigns its coefficient weights on every call) is left lazy arrays of
            # this thread, and the next pass over this instance may run on another (an
            # engine's worker after the self-check's batched step failed on the loading
            # thread; another engine sharing the instance): evaluated here, where they were made.
            settle(self.model)
            raise
        fed(caches, tokens.shape[1])
        return out


def settle(model: Any) -> None:
    """Evaluate, on this thread, every array a model instance holds: its parameters and the
    arrays its modules keep outside them (Gemma 3n's ``_std_multiplier``, computed in its
    constructor). A lazy array can only be evaluated on the thread whose stream it was made
    on ("There is no Stream(cpu, N) in current thread" elsewhere), and an instance is loaded
    and checked on one thread and run on the engine's worker."""
    kept = []
    for module in model.modules():
        values = [*vars(module).values(), *(v for k, v in module.items() if k.startswith("_"))]
        kept += [v for v in values if isinstance(v, mx.array)]
    mx.eval(model.parameters(), kept)


def forward_of(model: Any) -> ModelForward:
    """The ``ModelForward`` of a loaded model instance (made once, kept on the instance)."""
    made = model.__dict__.get("_agent_memory_forward")
    if made is None:
        made = ModelForward(model, describe(model).layout)
        model._agent_memory_forward = made
    return made


def prefill(
    model: Any, token_ids: Sequence[int], cache: list[Any], chunk_tokens: int = DEFAULT_CHUNK_TOKENS
) -> mx.array:
    """Run ``token_ids`` through the model into ``cache``; return the last position's logits
    (shape ``(vocab,)``, float32)."""
    if not token_ids:
        raise ValueError("prefill needs at least one token")
    logits = None
    for start in range(0, len(token_ids), chunk_tokens):
        chunk = token_ids[start : start + chunk_tokens]
        logits = prefill_chunk(model, chunk, cache, last=start + chunk_tokens >= len(token_ids))
    assert logits is not None
    return logits


def prefill_chunk(model: Any, token_ids: Sequence[int], cache: list[Any], last: bool) -> mx.array | None:
    """One chunk of a prefill; the logits of its last position if it is the ``last`` one."""
    if not token_ids:
        raise ValueError("prefill needs at least one token")
    logits = forward_of(model)(mx.array(token_ids)[None], cache, LAST)
    if not last:
        # Evaluated per chunk: bounds the graph and the memory of intermediate activations.
        mx.eval(logits, [c.state for c in cache])
        return None
    return logits[0, -1].astype(mx.float32)


def decode_step(model: Any, token_id: int | mx.array, cache: list[Any]) -> mx.array:
    """One decode step: logits (float32, ``(vocab,)``) after appending ``token_id``."""
    tok = token_id if isinstance(token_id, mx.array) else mx.array([token_id])
    return forward_of(model)(tok.reshape(1, 1), cache, None)[0, -1].astype(mx.float32)
