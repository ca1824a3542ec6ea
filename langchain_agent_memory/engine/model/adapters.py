"""Per-model-instance adapters: one loaded model's attention and MLP run our CPU kernels.

Why per instance: mlx-lm's model files call ``scaled_dot_product_attention`` and ``swiglu``
by their module-level names. Replacing those names (or a class method) would change every
other mlx-lm model in the process, and break silently on the next mlx-lm release. Here each
attention / MLP module *of this model instance* gets a subclass of its own class whose
``__call__`` is mlx-lm's own code bound to a private copy of its module's globals, where
those two names point at the kernels below. mlx-lm's modules, classes and every other
model are untouched; the forward code (projections, norms, RoPE, MLA, sinks) stays
mlx-lm's.

The attention kernel (``_Attention``):

- over an engine ``LayerCache`` / ``BatchLayerCache`` that fetched exactly these keys and
  values: the cache's own ``attend`` (BLAS attention on its working copy, rotated-space
  prefill, window mask from positions);
- over anything else (mlx-lm's ``KVCache``, keys an MLA layer derived from the cache's
  latent): ``fast_ops.attention`` on the arrays it is given, or mlx-lm's own function for
  quantized caches and attention sinks.

Only on the CPU: on Metal / CUDA mlx's fused kernels are the fast path, and the engine's
caches satisfy mlx-lm's cache protocol (real arrays, masks) so the stock code runs there.
"""

from __future__ import annotations

import functools
import logging
import types
from collections.abc import Callable
from typing import Any

from ..kv import BatchLayerCache, LayerCache
from ..runtime import mx
from . import fast_ops

logger = logging.getLogger(__name__)

#: Marks an adapted class (and so an adapted module instance).
ADAPTED = "_agent_memory_adapted"


class _Attention:
    """``scaled_dot_product_attention`` for one adapted class; ``original`` is mlx-lm's."""

    def __init__(self, original: Callable[..., mx.array]) -> None:
        self.original = original

    def __call__(
        self,
        queries: mx.array,
        keys: Any,
        values: Any,
        cache: Any,
        scale: float,
        mask: Any,
        sinks: mx.array | None = None,
    ) -> mx.array:
        if isinstance(cache, (LayerCache, BatchLayerCache)) and cache.fetched(keys, values):
            return cache.attend(queries, scale, sinks)
        if hasattr(cache, "bits") or sinks is not None:
            # mlx-lm's quantized caches hand over (packed, scales, biases); sinks: mx.fast.
            return self.original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
        return fast_ops.attention(queries, keys, values, scale, mask)


def _gemma3_mlp_call(self: Any, x: mx.array) -> mx.array:
    # gelu_approx(gate) * up in one pass over the output (mlx-lm: two).
    return self.down_proj(fast_ops.gelu_approx_mul(self.gate_proj(x), self.up_proj(x)))


#: ``__call__`` bodies we own, by mlx-lm class (module, qualified name).
_OWNED_CALLS: dict[tuple[str, str], Callable[..., Any]] = {
    ("mlx_lm.models.gemma3_text", "MLP"): _gemma3_mlp_call,
}


def _rebound(call: types.FunctionType) -> types.FunctionType | None:
    """``call`` with its global names of attention / swiglu pointing at our kernels; None if
    it uses neither."""
    names = set(call.__code__.co_names)
    replace: dict[str, Any] = {}
    if "scaled_dot_product_attention" in names:
        replace["scaled_dot_product_attention"] = _Attention(call.__globals__["scaled_dot_product_attention"])
    if "swiglu" in names:
        replace["swiglu"] = fast_ops.fast_swiglu
    if not replace:
        return None
    scope = {**call.__globals__, **replace}  # a private copy: the module's own dict is not touched
    fn = types.FunctionType(call.__code__, scope, call.__name__, call.__defaults__, call.__closure__)
    fn.__kwdefaults__ = call.__kwdefaults__
    fn.__qualname__ = call.__qualname__
    return fn


@functools.cache
def _adapted_class(cls: type) -> type | None:
    """A subclass of ``cls`` whose ``__call__`` uses our kernels (made once per class), or
    None when there is nothing to change."""
    if getattr(cls, ADAPTED, False):
        return None
    owned = _OWNED_CALLS.get((cls.__module__, cls.__qualname__))
    call = owned
    if call is None:
        original = next((k.__dict__["__call__"] for k in cls.__mro__ if "__call__" in k.__dict__), None)
        if not isinstance(original, types.FunctionType) or not original.__module__.startswith("mlx_lm."):
            return None
        call = _rebound(original)
        if call is None:
            return None
    return type(cls.__name__, (cls,), {"__call__": call, "__module__": __name__, ADAPTED: True})


def adapt_model(model: Any) -> int:
    """Run this model instance's attention and MLP modules on the CPU kernels of
    ``fast_ops``; return how many modules were adapted (0 off the CPU, or where mlx cannot
    JIT-compile; calling it again adapts nothing more)."""
    if mx.default_device() != mx.cpu:
        return 0  # Metal / CUDA: mlx's fused kernels are the fast path there
    if not fast_ops.jit_available():
        logger.warning("no g++ on PATH: mlx cannot JIT-compile CPU kernels; the model runs mlx's own")
        return 0
    n = 0
    for module in model.modules():
        sub = _adapted_class(type(module))
        if sub is not None:
            module.__class__ = sub  # this instance only
            n += 1
    return n


def is_adapted(model: Any) -> bool:
    """Whether ``adapt_model`` switched any module of this instance to our kernels."""
    return any(getattr(type(m), ADAPTED, False) for m in model.modules())
