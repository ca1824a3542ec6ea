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

Norms and RoPE (a decode step's small ops): on the CPU ``mx.fast.rms_norm`` and
``mx.fast.rope`` run as fallback graphs of ~8 and ~20 ops, and a decode step is thousands
of ops of a few microseconds each (SmolLM2: 4,067 per token, beside 211 weight GEMVs).
``RMSNorm`` modules run the fallback's formula compiled (``fast_ops.rms_norm``), and RoPE
modules rotate with tables computed once per step and shared by every layer with the same
configuration (``_RopeTables``): the same bits, checked against the module's own output when
a model is adapted (a module that differs keeps its own code).

Only on the CPU: on Metal / CUDA mlx's fused kernels are the fast path, and the engine's
caches satisfy mlx-lm's cache protocol (real arrays, masks) so the stock code runs there.

On every device, a module whose pass writes to the model (Gemma 3n's AltUp reassigns its
coefficient weights on each call: ``_PASS_METHODS``) gets methods that compute the same
values for the call alone: a pass then changes nothing the next one reads, whichever thread
runs it (a lazy array of one thread cannot be evaluated on another, and two engines sharing
the instance ran passes over it at once: a crash).
"""

from __future__ import annotations

import contextvars
import functools
import hashlib
import logging
import threading
import types
from collections.abc import Callable
from typing import Any

import mlx.nn as nn

from ..kv import BatchLayerCache, LayerCache, fetches
from ..ops import cpu_attention, fast_ops
from ..ops.runtime import mx, side_streams
from .structure import decoder_stack, text_model

logger = logging.getLogger(__name__)

#: Marks an adapted class (and so an adapted module instance): with which of these.
ADAPTED = "_agent_memory_adapted"
KERNELS = "kernels"  # attention through the caches, CPU kernels everywhere
ATTENTION_ONLY = "attention"  # attention through the caches, mlx's own ops elsewhere


class _Attention:
    """``scaled_dot_product_attention`` for one adapted class; ``original`` is mlx-lm's.
    ``kernels``: arrays of other caches go to ``fast_ops.attention`` (the CPU); otherwise to
    mlx-lm's own function."""

    def __init__(self, original: Callable[..., mx.array], kernels: bool) -> None:
        self.original = original
        self.kernels = kernels

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
        if isinstance(cache, LayerCache) and cache.spec.chunk is not None:
            pass  # chunked attention: the model's own mask over the real keys it fetched
        elif isinstance(cache, (LayerCache, BatchLayerCache)) and cache.fetched(keys, values):
            return cache.attend(queries, scale, sinks)
        owner = fetches.owner(keys, values) if cache is None else None
        if owner is not None:  # another layer's keys and values (Gemma 4's KV-shared layers)
            return owner.attend(queries, scale, sinks)
        if not self.kernels or hasattr(cache, "bits") or sinks is not None:
            # mlx-lm's quantized caches hand over (packed, scales, biases); sinks: mx.fast.
            return self.original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
        return cpu_attention.attention(queries, keys, values, scale, mask)


def _gemma3_mlp_call(self: Any, x: mx.array) -> mx.array:
    # gelu_approx(gate) * up in one pass over the output (mlx-lm: two).
    return self.down_proj(fast_ops.gelu_approx_mul(self.gate_proj(x), self.up_proj(x)))


def _rms_norm_call(self: Any, x: mx.array) -> mx.array:
    return fast_ops.rms_norm(x, self["weight"], self.eps)


def _rms_norm_1p_call(self: Any, x: mx.array) -> mx.array:
    return fast_ops.rms_norm_1p(x, self.weight, self.eps)


#: ``__call__`` bodies we own, by mlx-lm class (module, qualified name).
_OWNED_CALLS: dict[tuple[str, str], Callable[..., Any]] = {
    ("mlx_lm.models.gemma3_text", "MLP"): _gemma3_mlp_call,
    ("mlx.nn.layers.normalization", "RMSNorm"): _rms_norm_call,
    ("mlx_lm.models.gemma", "RMSNorm"): _rms_norm_1p_call,
    ("mlx_lm.models.gemma2", "RMSNorm"): _rms_norm_1p_call,
    ("mlx_lm.models.gemma3_text", "RMSNorm"): _rms_norm_1p_call,
}
_NORM_CALLS = (_rms_norm_call, _rms_norm_1p_call)


def _altup_coefs(self: Any, coefs: Any, modalities: mx.array) -> mx.array:
    """``coefs(modalities)`` (a linear layer without bias) with the weight mlx-lm's AltUp
    makes on every call (float32, clipped to ``altup_coef_clip``), made for this call only:
    mlx-lm assigns it to the layer, a write to the model in every pass."""
    weight = coefs.weight.astype(mx.float32)
    clip = self.config.altup_coef_clip
    if clip is not None:
        weight = mx.clip(weight, -clip, clip)
    return modalities @ weight.T


def _altup_predict(self: Any, x: mx.array) -> mx.array:
    # mlx-lm's ``Gemma3nAltUp.predict``, the coefficient weight made for the call.
    modalities = self.compute_router_modalities(x[self.config.altup_active_idx])
    n = self.config.altup_num_inputs
    all_coefs = _altup_coefs(self, self.prediction_coefs, modalities)
    all_coefs = all_coefs.reshape(*modalities.shape[:-1], n, n).transpose(0, 1, 3, 2)
    x_up = x.astype(mx.float32)
    predictions = mx.matmul(x_up.transpose(1, 2, 3, 0), all_coefs).transpose(3, 0, 1, 2)
    predictions += x_up
    return predictions.astype(x.dtype)


def _altup_correct(self: Any, predictions: mx.array, activated: mx.array) -> mx.array:
    # mlx-lm's ``Gemma3nAltUp.correct``, the coefficient weight made for the call.
    modalities = self.compute_router_modalities(activated)
    all_coefs = (_altup_coefs(self, self.correction_coefs, modalities) + 1.0).moveaxis(2, 0)
    innovation = activated - predictions[self.config.altup_active_idx]
    corrected = innovation[None] * all_coefs[..., None]
    corrected += predictions
    return corrected.astype(activated.dtype)


#: Methods of mlx-lm classes whose pass writes to the model, by class (module, qualified
#: name): ours compute the same values without the write (the module docstring says why).
_PASS_METHODS: dict[tuple[str, str], dict[str, Callable[..., Any]]] = {
    ("mlx_lm.models.gemma3n", "Gemma3nAltUp"): {"predict": _altup_predict, "correct": _altup_correct},
}

#: Positions per call up to which RoPE goes through ``fast_ops.rope_rotate`` (a decode step,
#: a turn's new tokens); a prefill chunk's fallback ops are large enough that their count
#: does not matter, and its tables would be large.
_ROPE_ROWS = 64


def _is_rope(cls: type) -> bool:
    """mlx's ``RoPE`` and mlx-lm's variants (Llama 3, YaRN, ...): ``dims`` rotated dims,
    ``traditional`` pair layout, ``__call__(x, offset)`` through ``mx.fast.rope``."""
    return cls.__name__.endswith("RoPE") and cls.__module__.startswith(("mlx.nn.", "mlx_lm."))


class _RopeTables:
    """One RoPE configuration's tables (``fast_ops.rope_table``) for the positions of the
    current call, shared by every layer with that configuration: a decode step computes them
    once (one run of the module's own op on ``fast_ops.rope_probe``), not once per layer.
    Per thread: a table is a lazy array of the thread that made it."""

    def __init__(self, rope: Any) -> None:
        self._rope = rope
        self._local = threading.local()

    def get(self, offset: int, L: int, dtype: mx.Dtype) -> mx.array:
        key = (offset, L, dtype)
        cached = getattr(self._local, "cached", None)
        if cached is not None and cached[0] == key:
            return cached[1]
        table = _rope_table(self._rope, offset, L, dtype)
        self._local.cached = (key, table)
        return table


def _rope_table(rope: Any, offset: int, L: int, dtype: mx.Dtype) -> mx.array:
    probe = fast_ops.rope_probe(rope.dims, L, dtype, rope.traditional)
    return fast_ops.rope_table(_own_call(rope)(probe, offset=offset), rope.traditional)


def _own_call(module: Any) -> Callable[..., Any]:
    """The adapted ``module``'s original ``__call__`` (its class's base), bound."""
    return super(type(module), module).__call__  # type: ignore[misc]


def _rope_call(self: Any, x: mx.array, offset: Any = 0, **kwargs: Any) -> mx.array:
    tables = self.__dict__.get("_agent_memory_rope")
    L = x.shape[-2]
    if tables is None or kwargs or not isinstance(offset, int) or L > _ROPE_ROWS:
        return _own_call(self)(x, offset=offset, **kwargs)  # batched offsets, a prefill
    table = tables.get(offset, L, x.dtype)
    dims = self.dims
    if dims == x.shape[-1]:
        return fast_ops.rope_rotate(x, table, self.traditional)
    rotated = fast_ops.rope_rotate(x[..., :dims], table, self.traditional)
    return mx.concatenate([rotated, x[..., dims:]], axis=-1)


#: A projection of this few rows onto a vocabulary of this many bytes of weights or more is
#: split across two CPU streams (``_split_projection``). Measured in the engine (A/B, one
#: process): Gemma 3's 671 MB decode 15.9 -> 18.9 tok/s, a hot turn's first token 122 -> 99
#: ms; SmolLM2's 113 MB no faster (24.1 vs 23.4 tok/s): the threshold is between.
_SPLIT_ROWS = 8
_SPLIT_BYTES = 128 << 20


def _split_projection(x: mx.array, weight: mx.array) -> mx.array | None:
    """``x @ weight.T``, the weight's two row halves on two CPU streams: the same bits (each
    logit is one row's dot product either way); None where it does not pay. Why: one GEMV
    runs on one core (MKL does not thread a one-row product), and a decode step or a turn's
    first token reads the whole vocabulary projection for one row: Gemma 3's tied embedding
    (671 MB of float32) 30.4-30.9 -> 20.3-22.8 ms alone."""
    stream = side_streams()[0]
    if stream is None or x.size // x.shape[-1] > _SPLIT_ROWS:
        return None
    half = weight.shape[0] // 2
    first = x @ weight[:half].T
    with mx.stream(stream):
        second = x @ weight[half:].T
    return mx.concatenate([first, second], axis=-1)


class _SplitHead(nn.Linear):
    """The model's ``lm_head`` (a plain ``nn.Linear`` without bias), split when it pays."""

    def __call__(self, x: mx.array) -> mx.array:
        out = _split_projection(x, self.weight)
        return super().__call__(x) if out is None else out


class _SplitEmbedding(nn.Embedding):
    """A tied embedding, whose ``as_linear`` is the head, split when it pays."""

    def as_linear(self, x: mx.array) -> mx.array:
        out = _split_projection(x, self.weight)
        return super().as_linear(x) if out is None else out


def switch_instance_class(module: Any, cls: type) -> None:
    """Switch this one module instance to ``cls``, a subclass of its own class (or back to
    the class it had): the one way this package changes another library's object (its
    class, and every other instance of it, stay as they are)."""
    if not (issubclass(cls, type(module)) or issubclass(type(module), cls)):
        raise TypeError(f"{cls.__name__} is neither a subclass nor a base of {type(module).__name__}")
    module.__class__ = cls


def _adapt_head(model: Any) -> int:
    """Switch this instance's vocabulary projection to its split form where it is large."""
    lm = text_model(model)
    stack = decoder_stack(model)
    heads = [lm["lm_head"]] if "lm_head" in lm else []
    heads += [m for m in (stack.children().values() if stack is not None else ()) if type(m) is nn.Embedding]
    n = 0
    for head in heads:
        if type(head) not in (nn.Linear, nn.Embedding) or "bias" in head or head.weight.nbytes < _SPLIT_BYTES:
            continue
        switch_instance_class(head, _SplitHead if type(head) is nn.Linear else _SplitEmbedding)
        n += 1
    return n


#: The rows of the decoder stack's output the model's head gets (``forward.ModelForward``):
#: "last" (each sequence's last position), an array of one position per sequence, or None.
STACK_ROWS: contextvars.ContextVar[Any] = contextvars.ContextVar("agent_memory_rows", default=None)
_CUTS_ROWS = "_agent_memory_cuts_rows"


def cut_rows(out: mx.array, rows: Any) -> mx.array:
    """``out`` (batch, positions, ...) at ``rows`` (see ``STACK_ROWS``)."""
    if rows is None:
        return out
    if isinstance(rows, str):
        return out[:, -1:]
    return out[mx.arange(out.shape[0]), rows][:, None]


def _cutting_call(self: Any, *args: Any, **kwargs: Any) -> Any:
    out = super(type(self), self).__call__(*args, **kwargs)
    rows = STACK_ROWS.get()
    return out if rows is None or not isinstance(out, mx.array) else cut_rows(out, rows)


@functools.cache
def _cutting(cls: type) -> type:
    return type(cls.__name__, (cls,), {"__call__": _cutting_call, "__module__": __name__, _CUTS_ROWS: True})


def select_stack_rows(stack: Any) -> None:
    """Switch this decoder stack instance to a subclass of its class whose output is cut to
    ``STACK_ROWS`` (unset: unchanged) before the model's head sees it; only this instance
    changes, once."""
    if not getattr(type(stack), _CUTS_ROWS, False):
        switch_instance_class(stack, _cutting(type(stack)))


def _probe_input(shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
    # A fixed key: checks are reproducible, and mlx's global RNG is not touched.
    return mx.random.normal(shape, key=mx.random.key(20261202)).astype(dtype)


_CHECKED_DTYPES = (mx.float32, mx.bfloat16, mx.float16)
_PROBE_OFFSETS = (0, 4093)


def _rope_signature(rope: Any) -> str | None:
    """What identifies ``rope``'s behaviour: its float32 outputs on a fixed input at two
    offsets (modules alike share tables); None where it lacks RoPE's ``dims`` and
    ``traditional``."""
    dims, traditional = getattr(rope, "dims", None), getattr(rope, "traditional", None)
    if not isinstance(dims, int) or not isinstance(traditional, bool) or dims % 2:
        return None
    digest = hashlib.sha256(f"{type(rope).__qualname__}/{dims}/{traditional}".encode())
    x = _probe_input((1, 2, 3, dims), mx.float32)
    for offset in _PROBE_OFFSETS:
        digest.update(bytes(memoryview(_own_call(rope)(x, offset=offset))))
    return digest.hexdigest()


def _rope_matches(rope: Any) -> bool:
    """Whether ``fast_ops.rope_rotate`` with ``rope``'s tables gives its own bits (each
    dtype, two offsets); not where it is a RoPE of another form."""
    for dtype in _CHECKED_DTYPES:
        x = _probe_input((1, 2, 3, rope.dims), dtype)
        for offset in _PROBE_OFFSETS:
            ref = _own_call(rope)(x, offset=offset)
            mine = fast_ops.rope_rotate(x, _rope_table(rope, offset, 3, dtype), rope.traditional)
            if not mx.array_equal(ref, mine).item():
                return False
    return True


def _norm_matches(module: Any) -> bool:
    """Whether the adapted norm ``module`` gives its original's bits (float32 and 16-bit)."""
    dims = module.weight.shape[-1]
    for dtype in _CHECKED_DTYPES:
        x = _probe_input((2, dims), dtype)
        if not mx.array_equal(module(x), _own_call(module)(x)).item():
            return False
    return True


def _rebound(call: types.FunctionType, kernels: bool) -> types.FunctionType | None:
    """``call`` with its global name of attention (and with ``kernels``, of swiglu) pointing
    at ours; None if it uses neither."""
    names = set(call.__code__.co_names)
    replace: dict[str, Any] = {}
    if "scaled_dot_product_attention" in names and "scaled_dot_product_attention" in call.__globals__:
        original = call.__globals__["scaled_dot_product_attention"]
        replace["scaled_dot_product_attention"] = _Attention(original, kernels)
    if "swiglu" in names and "swiglu" in call.__globals__ and kernels:
        replace["swiglu"] = fast_ops.fast_swiglu
    if not replace:
        return None
    scope = {**call.__globals__, **replace}  # a private copy: the module's own dict is not touched
    fn = types.FunctionType(call.__code__, scope, call.__name__, call.__defaults__, call.__closure__)
    fn.__kwdefaults__ = call.__kwdefaults__
    fn.__qualname__ = call.__qualname__
    return fn


@functools.cache
def _adapted_class(cls: type, kernels: bool) -> type | None:
    """A subclass of ``cls`` whose ``__call__`` attends through the engine's caches and, with
    ``kernels``, uses the CPU kernels, or whose pass no longer writes to the model
    (``_PASS_METHODS``) (made once per class), or None when there is nothing to change."""
    if getattr(cls, ADAPTED, False):
        return None
    mark = KERNELS if kernels else ATTENTION_ONLY
    methods = _PASS_METHODS.get((cls.__module__, cls.__qualname__))
    if methods is not None:
        return type(cls.__name__, (cls,), {**methods, "__module__": __name__, ADAPTED: mark})
    owned = None
    if kernels:
        owned = _rope_call if _is_rope(cls) else _OWNED_CALLS.get((cls.__module__, cls.__qualname__))
    call = owned
    if call is None:
        original = next((k.__dict__["__call__"] for k in cls.__mro__ if "__call__" in k.__dict__), None)
        if not isinstance(original, types.FunctionType) or not original.__module__.startswith("mlx_lm."):
            return None
        call = _rebound(original, kernels)
        if call is None:
            return None
    return type(cls.__name__, (cls,), {"__call__": call, "__module__": __name__, ADAPTED: mark})


def adapt_model(model: Any) -> int:
    """Run this model instance's attention through the engine's caches (``LayerCache.attend``:
    the stored form or a working copy) and, on the CPU, its attention, MLP, norms and RoPE on
    the kernels of ``fast_ops``; return how many modules were adapted (calling it again
    adapts nothing more). Off the CPU, or where mlx cannot JIT-compile, only the attention
    call is rebound: mlx's fused kernels do the rest."""
    kernels = mx.default_device() == mx.cpu
    if kernels and not fast_ops.jit_available():
        logger.warning("no g++ on PATH: mlx cannot JIT-compile CPU kernels; the model runs mlx's own")
        kernels = False
    n = 0
    ropes: dict[str, _RopeTables] = {}
    matches: dict[Any, bool] = {}  # per norm class and weight dtype, per RoPE signature: checked once
    for module in model.modules():
        cls = type(module)
        sub = _adapted_class(cls, kernels)
        if sub is None:
            continue
        switch_instance_class(module, sub)
        if sub.__call__ in _NORM_CALLS:
            key = (cls, module.weight.dtype)
            if key not in matches:
                matches[key] = _norm_matches(module)
            if not matches[key]:
                switch_instance_class(module, cls)
                logger.info("%s keeps its own code: the compiled norm differs", cls.__qualname__)
                continue
        if _is_rope(cls):
            signature = _rope_signature(module)
            if signature is not None and signature not in matches:
                matches[signature] = _rope_matches(module)
            if signature is None or not matches[signature]:
                switch_instance_class(module, cls)
                logger.info("%s keeps its own code: not the form of a rotation table", cls.__qualname__)
                continue
            module._agent_memory_rope = ropes.setdefault(signature, _RopeTables(module))
        n += 1
    return n + (_adapt_head(model) if kernels else 0)


def is_adapted(model: Any) -> bool:
    """Whether ``adapt_model`` switched any module of this instance to the CPU kernels."""
    return any(getattr(type(m), ADAPTED, None) == KERNELS for m in model.modules())


def attends_through_caches(model: Any) -> bool:
    """Whether this instance's attention calls ``LayerCache.attend`` (``adapt_model``: the
    CPU kernels, or only the attention call on a GPU)."""
    return any(getattr(type(m), ADAPTED, None) for m in model.modules())
