"""KV caches: how keys and values are stored (``codecs``), one agent's per-layer cache
(``layer``), several agents stepped together (``batch``), and a model's cache shape
(``spec``)."""

from .batch import BatchLayerCache, batch_layer_caches
from .codecs import (
    FULL,
    KV_BITS_PRESET,
    KV_PRESETS,
    ROTATION_SCHEME,
    KVQuant,
    TensorCodec,
    kv_format,
    preset_name,
    rotation,
    rotation_signs,
    unpack_affine,
)
from .layer import LayerCache, make_layer_caches, positional_mask
from .recurrent import BatchRecurrentCache, RecurrentCache
from .spec import LayerSpec, ModelCacheSpec

__all__ = [
    "FULL",
    "KV_BITS_PRESET",
    "KV_PRESETS",
    "ROTATION_SCHEME",
    "BatchLayerCache",
    "BatchRecurrentCache",
    "KVQuant",
    "LayerCache",
    "LayerSpec",
    "ModelCacheSpec",
    "RecurrentCache",
    "TensorCodec",
    "batch_layer_caches",
    "kv_format",
    "make_layer_caches",
    "positional_mask",
    "preset_name",
    "rotation",
    "rotation_signs",
    "unpack_affine",
]
