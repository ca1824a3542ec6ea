"""Model-quality measurements shared by tests and benchmarks (no LangChain here)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import mlx.nn as nn
import numpy as np

from .runtime import mx

#: token ids (one sequence) -> logits, shape (len(ids), vocab)
LogitsFn = Callable[[list[int]], Any]


def mlx_logits(model: Any) -> LogitsFn:
    """A `LogitsFn` for an mlx-lm model (no cache: each call is one forward pass)."""

    def run(ids: list[int]) -> Any:
        return model(mx.array(ids)[None])[0].astype(mx.float32)

    return run


def perplexity(
    model: Any | LogitsFn, token_ids: Sequence[int], window: int = 512, stride: int = 256
) -> float:
    """Perplexity over ``token_ids`` with windows of ``window`` tokens moved by ``stride``.

    Each token is scored once, with up to ``window - stride`` tokens of context before the
    first scored one (the usual strided evaluation). ``model``: an mlx-lm model or any
    `LogitsFn` (e.g. llama.cpp's), so that two runtimes are scored identically.
    """
    logits_fn: LogitsFn = mlx_logits(model) if isinstance(model, nn.Module) else model
    ids = list(token_ids)
    if len(ids) < 2:
        raise ValueError("perplexity needs at least two tokens")
    nll, count, scored_to, start = 0.0, 0, 1, 0  # token 0 is never predicted
    while scored_to < len(ids):
        end = min(start + window, len(ids))
        logits = np.asarray(logits_fn(ids[start : end - 1]), dtype=np.float64)
        logits -= logits.max(axis=-1, keepdims=True)
        logprobs = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
        targets = np.asarray(ids[start + 1 : end])
        lp = logprobs[np.arange(len(targets)), targets]
        part = lp[scored_to - start - 1 :]  # the tokens not scored by an earlier window
        nll -= float(part.sum())
        count += len(part)
        scored_to = end
        start += stride
    return math.exp(nll / count)
