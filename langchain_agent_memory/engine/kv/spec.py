"""What a model's KV cache looks like, per layer: the shape contract between a model and
the stored blocks.

The spec is *probed*, not parsed from config files: the model builds its own mlx-lm cache
list (``make_prompt_cache``: full layers get a ``KVCache``, sliding-window layers a
``RotatingKVCache(window)``) and runs one token through it; the shapes it stores are the
truth, whatever the architecture calls its heads (MLA models such as deepseek_v2 store
per-head keys of ``qk_nope + qk_rope`` dims and values of ``v_head_dim``: K != V).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

from ..ops.runtime import mx


@dataclass(frozen=True, slots=True)
class LayerSpec:
    kv_heads: int
    k_head_dim: int
    v_head_dim: int
    window: int | None  # None: full attention; else the sliding-window size in tokens

    @property
    def sliding(self) -> bool:
        return self.window is not None


@dataclass(frozen=True, slots=True)
class ModelCacheSpec:
    layers: tuple[LayerSpec, ...]
    dtype: str  # float type of the model's activations ("float32", "bfloat16", ...)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def fp16_bytes_per_token(self) -> int:
        """Bytes one token's K and V take in all layers at 16 bits (the reference size)."""
        return sum(2 * s.kv_heads * (s.k_head_dim + s.v_head_dim) for s in self.layers)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    def digest(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    @classmethod
    def from_model(cls, model: Any) -> ModelCacheSpec:
        from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

        caches = make_prompt_cache(model)
        windows: list[int | None] = []
        for c in caches:
            if isinstance(c, RotatingKVCache):
                windows.append(int(c.max_size))
            elif isinstance(c, KVCache):
                windows.append(None)
            else:
                raise ValueError(
                    f"unsupported cache type {type(c).__name__} in {type(model).__name__}: "
                    "only attention layers (KVCache / RotatingKVCache) can be stored"
                )
        out = model(mx.array([[0]]), cache=caches)
        mx.eval(out)
        layers = []
        for c, window in zip(caches, windows, strict=True):
            _, heads, _, k_dim = c.keys.shape
            layers.append(LayerSpec(int(heads), int(k_dim), int(c.values.shape[-1]), window))
        dtype = str(caches[0].keys.dtype).removeprefix("mlx.core.")
        return cls(tuple(layers), dtype)
