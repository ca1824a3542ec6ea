"""Forward passes of an mlx-lm decoder, split the way an engine needs them.

mlx-lm's ``model(tokens)`` projects *every* position onto the vocabulary. A prefill needs
the logits of the last position only: for Gemma 3 (262K vocabulary, 640 wide) the
full projection of a 512-token chunk is 172 GFLOP, more than the rest of the model. So a
prefill runs the backbone (``model.model``) chunk by chunk and projects one position.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..runtime import mx

DEFAULT_CHUNK_TOKENS = 512


def logits_from_hidden(model: Any, hidden: mx.array) -> mx.array:
    """The vocabulary projection mlx-lm's decoders apply after their final norm."""
    if "lm_head" in model:
        return model.lm_head(hidden)
    return model.model.embed_tokens.as_linear(hidden)


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
    hidden = model.model(mx.array(token_ids)[None], cache=cache)
    if not last:
        # Evaluated per chunk: bounds the graph and the memory of intermediate activations.
        mx.eval(hidden[:, -1:], [c.state for c in cache])
        return None
    return logits_from_hidden(model, hidden[:, -1:])[0, -1].astype(mx.float32)


def decode_step(model: Any, token_id: int | mx.array, cache: list[Any]) -> mx.array:
    """One decode step: logits (float32, ``(vocab,)``) after appending ``token_id``."""
    tok = token_id if isinstance(token_id, mx.array) else mx.array([token_id])
    return model(tok.reshape(1, 1), cache=cache)[0, -1].astype(mx.float32)
