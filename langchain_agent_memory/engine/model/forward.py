"""Forward passes of an mlx-lm decoder, split the way an engine needs them.

mlx-lm's ``model(tokens)`` projects *every* position onto the vocabulary. A prefill needs
the logits of the last position only: for Gemma 3 (262K vocabulary, 640 wide) the
full projection of a 512-token chunk is 172 GFLOP, more than the rest of the model. So a
prefill runs the backbone (``model.model``) chunk by chunk and projects one position.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.nn as nn

from ..kv.recurrent import fed
from ..ops.runtime import mx, side_streams

DEFAULT_CHUNK_TOKENS = 512
#: A projection of this few rows onto a vocabulary of this many bytes of weights or more is
#: split across two CPU streams (``_split_projection``). Measured in the engine (A/B, one
#: process): Gemma 3's 671 MB decode 15.9 -> 18.9 tok/s, a hot turn's first token 122 -> 99
#: ms; SmolLM2's 113 MB no faster (24.1 vs 23.4 tok/s): the threshold is between.
_SPLIT_ROWS = 8
_SPLIT_BYTES = 128 << 20


def logits_from_hidden(model: Any, hidden: mx.array) -> mx.array:
    """The vocabulary projection mlx-lm's decoders apply after their final norm."""
    model = text_model(model)
    if "lm_head" in model:
        head = model.lm_head
        project, plain = head, type(head) is nn.Linear and "bias" not in head
    else:
        stack = backbone(model)
        head = stack.embed_tokens if "embed_tokens" in stack else stack.embeddings
        project, plain = head.as_linear, type(head) is nn.Embedding
    if plain and hidden.size // hidden.shape[-1] <= _SPLIT_ROWS and head.weight.nbytes >= _SPLIT_BYTES:
        stream = side_streams()[0]
        if stream is not None:
            return _split_projection(hidden, head.weight, stream)
    return project(hidden)


def _split_projection(hidden: mx.array, weight: mx.array, stream: Any) -> mx.array:
    """``hidden @ weight.T``, the weight's two row halves on two CPU streams: the same bits
    (each logit is one row's dot product either way). Why: one GEMV runs on one core (MKL
    does not thread a one-row product), and a decode step or a turn's first token reads the
    whole vocabulary projection for one row: Gemma 3's tied embedding (671 MB of float32)
    30.4-30.9 -> 20.3-22.8 ms alone."""
    half = weight.shape[0] // 2
    first = hidden @ weight[:half].T
    with mx.stream(stream):
        second = hidden @ weight[half:].T
    return mx.concatenate([first, second], axis=-1)


def text_model(model: Any) -> Any:
    """The language model of a multimodal wrapper (Qwen 3.5's ``language_model``), else
    the model itself."""
    return getattr(model, "language_model", model)


def backbone(model: Any) -> Any:
    """The decoder stack without the vocabulary projection (``model.model``; Nemotron-H
    calls it ``backbone``)."""
    lm = text_model(model)
    return lm.model if "model" in lm else lm.backbone


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
    hidden = backbone(model)(mx.array(token_ids)[None], cache=cache)
    fed(cache, len(token_ids))
    if not last:
        # Evaluated per chunk: bounds the graph and the memory of intermediate activations.
        mx.eval(hidden[:, -1:], [c.state for c in cache])
        return None
    return logits_from_hidden(model, hidden[:, -1:])[0, -1].astype(mx.float32)


def decode_step(model: Any, token_id: int | mx.array, cache: list[Any]) -> mx.array:
    """One decode step: logits (float32, ``(vocab,)``) after appending ``token_id``."""
    tok = token_id if isinstance(token_id, mx.array) else mx.array([token_id])
    hidden = backbone(model)(tok.reshape(1, 1), cache=cache)
    fed(cache, 1)
    return logits_from_hidden(model, hidden)[0, -1].astype(mx.float32)
