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

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.nn as nn

from ..errors import UnsupportedModelError
from ..kv import LayerSpec, ModelCacheSpec
from ..ops.runtime import mx

#: A model cache entry: an index into the engine's flat list, None for a cache the model
#: never fills (it gets a fresh one of mlx-lm's each call), or a ``CacheList`` of those.
Slot = int | None
Entry = Slot | tuple[Slot, ...]


@dataclass(frozen=True, slots=True)
class CacheLayout:
    """How the model's cache list is made of the engine's flat list of layer caches."""

    entries: tuple[Entry, ...]
    #: Per flat slot: the mlx-lm cache it stands for, as a user reads it (``RotatingKVCache(48)``).
    kinds: tuple[str, ...]

    @property
    def plain(self) -> bool:
        """Whether the model's list is the engine's list itself (one cache per entry, all used)."""
        return self.entries == tuple(range(len(self.kinds)))

    def assemble(self, flat: Sequence[Any]) -> list[Any]:
        """The model's cache list over the engine's ``flat`` caches (the same objects)."""
        if self.plain:
            return list(flat)
        from mlx_lm.models.cache import CacheList, KVCache

        def slot(i: Slot) -> Any:
            return KVCache() if i is None else flat[i]

        return [CacheList(*map(slot, e)) if isinstance(e, tuple) else slot(e) for e in self.entries]

    def summary(self) -> str:
        """``KVCache ×2, RotatingKVCache(48) ×2``; a layer that keeps two as ``CacheList(a+b)``;
        a cache the model never fills as ``unused``."""

        def kind(i: Slot) -> str:
            return "unused" if i is None else self.kinds[i]

        names = [
            f"CacheList({'+'.join(map(kind, e))})" if isinstance(e, tuple) else kind(e) for e in self.entries
        ]
        return ", ".join(f"{k} ×{n}" if n > 1 else k for k, n in Counter(names).items())

    def without(self, unused: set[int]) -> CacheLayout:
        """This layout with the slots in ``unused`` taken out of the engine's list."""
        renumber = {}
        for i in range(len(self.kinds)):
            if i not in unused:
                renumber[i] = len(renumber)

        def slot(i: Slot) -> Slot:
            return None if i is None else renumber.get(i)

        entries = tuple(tuple(map(slot, e)) if isinstance(e, tuple) else slot(e) for e in self.entries)
        return CacheLayout(entries, tuple(k for i, k in enumerate(self.kinds) if i not in unused))

    def leaves(self, caches: Sequence[Any]) -> list[Any]:
        """The caches of a model's cache list that stand for the engine's slots, in order
        (``CacheList`` entries opened, unused ones left out)."""
        out: list[Any] = [None] * len(self.kinds)
        for entry, cache in zip(self.entries, caches, strict=True):
            for i, part in (
                zip(entry, cache.caches, strict=True) if isinstance(entry, tuple) else [(entry, cache)]
            ):
                if i is not None:
                    out[i] = part
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
    """A leaf cache's window (None: all tokens), ``"state"`` for a recurrent one,
    ``"chunk:N"`` for chunked attention; refuses the kinds the engine cannot store."""
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
    if kind is mc.ChunkedKVCache:
        return f"chunk:{int(cache.chunk_size)}"
    raise UnsupportedModelError(
        f"{where} is a {kind.__module__}.{kind.__qualname__}, a cache kind agent-memory cannot "
        "store (it stores KVCache, RotatingKVCache, ChunkedKVCache, ArraysCache / MambaCache and "
        "CacheList of those)"
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
    Sixteen tokens: a state every recurrent layer fills and holds at its full size (one
    could leave a convolution window's entry unset; LongCat-Flash-NGram's token history
    grows to its n-gram's length). A cache the pass left empty is one the model never uses
    (Nemotron-NAS's layers without attention): no slot of the engine's."""
    layout, caches, windows = layout_of(model)
    mx.eval(model(mx.array([[0] * 16]), cache=caches))
    name = type(model).__module__.removeprefix("mlx_lm.models.")
    leaves = layout.leaves(caches)
    unused = {
        i for i, (c, w) in enumerate(zip(leaves, windows, strict=True)) if w != "state" and c.keys is None
    }
    if len(unused) == len(leaves):
        raise UnsupportedModelError(
            f"{name}: no cache holds anything after a forward pass: the model keeps its keys "
            "and values outside the caches it is given"
        )
    kept = [i for i in range(len(leaves)) if i not in unused]
    spec = _spec(name, [leaves[i] for i in kept], [windows[i] for i in kept])
    return ModelStructure(layout.without(unused), spec)


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
        _, heads, _, k_dim = cache.keys.shape
        chunk = int(window.removeprefix("chunk:")) if isinstance(window, str) else None
        span = window if isinstance(window, int) else None
        layers.append(LayerSpec(int(heads), int(k_dim), int(cache.values.shape[-1]), span, chunk=chunk))
        dtype = dtype or _dtype_name(cache.keys.dtype)
    if not dtype:  # a pure state-space model: the activations' dtype is its states'
        dtype = next(s for spec in layers if spec.state for _, s in spec.state)
    return ModelCacheSpec(tuple(layers), dtype)


def _dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")
