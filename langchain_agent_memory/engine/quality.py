"""Model-quality measurements shared by tests and benchmarks (no LangChain here)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from .runtime import mx


def perplexity(model: Any, token_ids: Sequence[int], window: int = 512, stride: int = 256) -> float:
    """Perplexity over ``token_ids`` with sliding windows of ``window`` tokens moved by
    ``stride``; each token is scored once, with up to ``window - stride`` tokens of context
    before the first scored one (the usual strided evaluation)."""
    ids = list(token_ids)
    if len(ids) < 2:
        raise ValueError("perplexity needs at least two tokens")
    nll, count, scored_to = 0.0, 0, 1  # token 0 is never predicted
    start = 0
    while scored_to < len(ids):
        end = min(start + window, len(ids))
        chunk = mx.array(ids[start:end])[None]
        logits = model(chunk[:, :-1]).astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        targets = chunk[:, 1:]
        lp = mx.take_along_axis(logprobs, targets[..., None], axis=-1)[0, :, 0]
        first = scored_to - start - 1  # index into lp of the first token not yet scored
        part = lp[first:]
        nll -= float(part.sum().item())
        count += part.shape[0]
        scored_to = end
        if end == len(ids):
            break
        start += stride
    return math.exp(nll / count)
