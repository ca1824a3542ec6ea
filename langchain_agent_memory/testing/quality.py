"""Model-quality measurements shared by tests and benchmarks (no LangChain here)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import mlx.nn as nn
import numpy as np

from ..engine.ops.runtime import mx

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


def _fill_pending(model: Any, caches: list[Any], token_ids: Sequence[int], chunk: int = 512) -> None:
    """Run ``token_ids`` through the model into the caches' full-precision pending part."""
    from ..engine.model.forward import prefill

    prefill(model, token_ids, caches, chunk)


def clone_with_format(caches: list[Any], quant: Any, serve_stored: bool = False) -> list[Any]:
    """Copies of layer caches whose pending tokens will be stored as ``quant`` on commit
    (a full-precision prefill done once serves every KV format compared); ``serve_stored``:
    they attend over their stored form (``LayerCache``), not a working copy."""
    from ..engine.kv import LayerCache

    out = []
    for c in caches:
        n = LayerCache(
            c.spec, quant.for_dims(c.spec.k_head_dim, c.spec.v_head_dim), c.dtype, serve_stored=serve_stored
        )
        n.committed.start, n.offset = c.start, c.offset
        n.set_pending(c.pending_k, c.pending_v)
        out.append(n)
    return out


def stored_context_nll(
    model: Any, caches: list[Any], targets: Sequence[int], score_chunk: int = 32
) -> tuple[float, int]:
    """Negative log-likelihood of ``targets`` continuing the context in ``caches`` (which is
    committed first, i.e. stored in its KV format), fed ``score_chunk`` tokens at a time
    with a commit after each: every scored token attends to stored keys for all but the
    < ``score_chunk`` tokens before it in its own chunk, as in a conversation."""
    from ..engine.model.forward import forward_of

    for c in caches:
        c.commit()
    nll, count = 0.0, 0
    ids = list(targets)
    for start in range(0, len(ids) - 1, score_chunk):
        chunk = ids[start : start + score_chunk + 1]
        logits = forward_of(model)(mx.array(chunk[:-1])[None], caches, None)[0].astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        lp = mx.take_along_axis(logprobs, mx.array(chunk[1:])[:, None], axis=-1)
        nll -= float(lp.sum().item())
        count += len(chunk) - 1
        for c in caches:
            c.commit()
    return nll, count


def stored_perplexity(
    model: Any,
    spec: Any,
    formats: dict[str, Any],
    token_ids: Sequence[int],
    windows: int,
    serve_stored: bool = False,
) -> dict[str, float]:
    """Perplexity per KV format with 512-token windows moved by 256: in each window the
    first 256 tokens are the context (prefilled once at full precision, then *stored* in
    the format) and the next 256 are scored as ``stored_context_nll`` does."""
    from ..engine.kv import KVQuant, make_layer_caches

    nll = dict.fromkeys(formats, 0.0)
    count = dict.fromkeys(formats, 0)
    ids = list(token_ids)
    if len(ids) < (windows + 1) * 256:
        raise ValueError(f"{windows} windows need {(windows + 1) * 256} tokens; got {len(ids)}")
    for w in range(windows):
        window = ids[w * 256 : w * 256 + 512]
        base = make_layer_caches(spec, KVQuant.uniform(None))
        _fill_pending(model, base, window[:256])
        for name, fmt in formats.items():
            n, c = stored_context_nll(model, clone_with_format(base, fmt, serve_stored), window[255:])
            nll[name] += n
            count[name] += c
    return {name: math.exp(nll[name] / count[name]) for name in formats}


def kv_roundtrip_errors(caches: list[Any], quant: Any) -> list[tuple[float, float]]:
    """Per layer, relative L2 error of K and V after a round trip through ``quant``
    (undoing a rotation), on the pending (full-precision) keys and values of ``caches``."""
    from ..engine.kv import rotation

    out = []
    for c in caches:
        errs = []
        fitted = quant.for_dims(c.spec.k_head_dim, c.spec.v_head_dim)
        for x, codec in ((c.pending_k, fitted.keys), (c.pending_v, fitted.values)):
            x = x.astype(mx.float32)
            back = codec.decode(codec.encode(x), mx.float32)
            if codec.rotate:
                back = back @ rotation(x.shape[-1]).T
            errs.append((mx.linalg.norm(back - x) / mx.linalg.norm(x)).item())
        out.append((errs[0], errs[1]))
    return out
