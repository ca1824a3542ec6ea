"""What a loaded model keeps per layer, decided from the model itself, not from its name.

A model says what it keeps through its own cache list (``make_cache()``, else one
``KVCache`` per layer: mlx-lm's ``make_prompt_cache``). Each entry maps to one of the
engine's layer kinds:

- ``KVCache``: an attention layer (all tokens) -> ``LayerCache``, stored in blocks;
- ``RotatingKVCache(window)``: a sliding-window layer -> ``LayerCache`` with that window;
- ``ArraysCache`` / ``MambaCache``: a recurrent layer (SSM, linear attention) ->
  ``RecurrentCache``, its state snapshotted at block boundaries;
- ``CacheList(a, b)``: one layer keeping both (Falcon-H1's mixer and attention) -> the
  engine keeps ``a`` and ``b`` as two entries of its flat list, and hands the model a
  ``CacheList`` of its own caches for that layer;
- layers that reuse an earlier layer's keys and values (Gemma 4's ``num_kv_shared_layers``)
  have no entry: the model's list is shorter than its layers, and so is the engine's.

Anything else (a cache class of a model's own, a rotating cache that keeps its first
tokens) is refused with the layer and the kind. Whether the model really reaches its keys
and values through these caches is what ``self_check`` then verifies on the loaded model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.nn as nn

from ..kv import LayerSpec, ModelCacheSpec
from ..ops.runtime import mx


class UnsupportedModelError(ValueError):
    """The model keeps something the engine cannot store, or computes differently over the
    engine's caches than over mlx-lm's own (``self_check``)."""


#: A model cache entry: an index into the engine's flat list, or a ``CacheList`` of them.
Entry = int | tuple[int, ...]


@dataclass(frozen=True, slots=True)
class CacheLayout:
    """How the model's cache list is made of the engine's flat list of layer caches."""

    entries: tuple[Entry, ...]
    #: Per flat slot: the mlx-lm cache it stands for, as a user reads it (``RotatingKVCache(48)``).
    kinds: tuple[str, ...]

    @property
    def nested(self) -> bool:
        return any(isinstance(e, tuple) for e in self.entries)

    def assemble(self, flat: Sequence[Any]) -> list[Any]:
        """The model's cache list over the engine's ``flat`` caches (the same objects)."""
        if not self.nested:
            return list(flat)
        from mlx_lm.models.cache import CacheList

        return [flat[e] if isinstance(e, int) else CacheList(*(flat[i] for i in e)) for e in self.entries]

    def leaves(self, caches: Sequence[Any]) -> list[Any]:
        """The flat list of a model's cache list (``CacheList`` entries opened)."""
        out: list[Any] = []
        for entry, cache in zip(self.entries, caches, strict=True):
            out.extend(cache.caches if isinstance(entry, tuple) else [cache])
        return out


@dataclass(frozen=True, slots=True)
class ModelStructure:
    """A loaded model's caches as the engine keeps them: the layout and each slot's shapes."""

    layout: CacheLayout
    spec: ModelCacheSpec


def text_model(model: Any) -> Any:
    """The language model of a multimodal wrapper (``language_model``, followed as far as it
    goes: Gemma 3, Qwen 3.5, Llama 4, Mistral 3), else the model itself."""
    while isinstance(model, nn.Module) and "language_model" in model:
        model = model["language_model"]
    return model


def decoder_stack(model: Any) -> nn.Module | None:
    """The module of ``model``'s language model that runs the decoder layers (``model``,
    ``backbone``, ``transformer``...: the one child holding a list of modules, ``layers``,
    ``h`` or ``blocks``), whose output the model's own head turns into logits; None where no
    one child does (the model is then run whole and its logits cut: slower, as correct)."""
    lm = text_model(model)
    found = [m for m in lm.children().values() if isinstance(m, nn.Module) and _holds_layers(m)]
    return found[0] if len(found) == 1 else None


def _holds_layers(module: nn.Module) -> bool:
    return any(
        isinstance(v, list) and v and all(isinstance(x, nn.Module) for x in v)
        for v in module.children().values()
    )


def _kind(cache: Any) -> str:
    from mlx_lm.models.cache import RotatingKVCache

    if isinstance(cache, RotatingKVCache):
        keep = f", keep={cache.keep}" if cache.keep else ""
        return f"RotatingKVCache({cache.max_size}{keep})"
    return type(cache).__name__


def _window(cache: Any, where: str) -> int | str | None:
    """A leaf cache's window (None: all tokens), ``"state"`` for a recurrent one; refuses the
    kinds the engine cannot store."""
    from mlx_lm.models import cache as mc

    kind = type(cache)
    if kind is mc.KVCache:
        return None
    if kind is mc.RotatingKVCache:
        if cache.keep:
            raise UnsupportedModelError(
                f"{where} is a {_kind(cache)}: a sliding window that also keeps its first "
                f"{cache.keep} tokens, which agent-memory cannot store yet"
            )
        return int(cache.max_size)
    if issubclass(kind, mc.ArraysCache) and kind.__module__ == mc.__name__:
        return "state"
    raise UnsupportedModelError(
        f"{where} is a {kind.__module__}.{kind.__qualname__}, a cache kind agent-memory cannot "
        "store (it stores KVCache, RotatingKVCache, ArraysCache / MambaCache and CacheList of those)"
    )


def layout_of(model: Any) -> tuple[CacheLayout, list[Any], list[int | str | None]]:
    """The model's cache layout, the fresh mlx-lm caches it was read from (flat), and each
    slot's window (None: all tokens; ``"state"``: recurrent); ``UnsupportedModelError``
    names the layer and the kind the engine cannot store."""
    from mlx_lm.models.cache import CacheList, make_prompt_cache

    name = type(model).__module__.removeprefix("mlx_lm.models.")
    caches = make_prompt_cache(model)
    entries: list[Entry] = []
    leaves: list[Any] = []
    windows: list[int | str | None] = []
    kinds: list[str] = []
    for i, cache in enumerate(caches):
        parts = list(cache.caches) if type(cache) is CacheList else [cache]
        for j, part in enumerate(parts):
            where = f"{name}: layer {i}" + (f" (part {j} of its CacheList)" if len(parts) > 1 else "")
            if type(part) is CacheList:
                raise UnsupportedModelError(f"{where} nests a CacheList in a CacheList")
            windows.append(_window(part, where))
            kinds.append(_kind(part))
            leaves.append(part)
        first = len(windows) - len(parts)
        entries.append(tuple(range(first, len(windows))) if type(cache) is CacheList else first)
    if not windows:
        raise UnsupportedModelError(f"{name}: the model keeps no cache (make_cache() is empty)")
    return CacheLayout(tuple(entries), tuple(kinds)), caches, windows


def describe(model: Any) -> ModelStructure:
    """The model's structure, probed: its own cache list, then two tokens through the model
    over it, so that every slot's shapes are the ones it really stores (an MLA layer's keys
    and values differ in width; a recurrent layer's state has the shapes of its arrays).
    Two tokens: a state every recurrent layer fills (one could leave a convolution window's
    entry unset on a first step)."""
    layout, caches, windows = layout_of(model)
    mx.eval(model(mx.array([[0, 0]]), cache=caches))
    name = type(model).__module__.removeprefix("mlx_lm.models.")
    return ModelStructure(layout, _spec(name, layout.leaves(caches), windows))


def _spec(name: str, leaves: list[Any], windows: list[int | str | None]) -> ModelCacheSpec:
    layers: list[LayerSpec] = []
    dtype = ""
    for i, (cache, window) in enumerate(zip(leaves, windows, strict=True)):
        if window == "state":
            if any(x is None for x in cache.cache):
                raise UnsupportedModelError(f"{name}: recurrent layer {i} left part of its state unset")
            state = tuple((tuple(int(d) for d in x.shape[1:]), _dtype_name(x.dtype)) for x in cache.cache)
            layers.append(LayerSpec(0, 0, 0, None, state))
            continue
        if cache.keys is None:
            raise UnsupportedModelError(
                f"{name}: layer {i}'s {_kind(cache)} holds nothing after a forward pass: the "
                "model does not keep its keys and values in it"
            )
        _, heads, _, k_dim = cache.keys.shape
        assert window is None or isinstance(window, int)
        layers.append(LayerSpec(int(heads), int(k_dim), int(cache.values.shape[-1]), window))
        dtype = dtype or _dtype_name(cache.keys.dtype)
    if not dtype:  # a pure state-space model: the activations' dtype is its states'
        dtype = next(s for spec in layers if spec.state for _, s in spec.state)
    return ModelCacheSpec(tuple(layers), dtype)


def _dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")
