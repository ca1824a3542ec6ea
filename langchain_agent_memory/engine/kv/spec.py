"""What a model's KV cache looks like, per layer: the shape contract between a model and
the stored blocks.

The spec is *probed* from the loaded model (``model.structure.describe``), not parsed from
config files: the shapes its own caches store are the truth, whatever the architecture
calls its heads (MLA models such as deepseek_v2 store per-head keys of ``qk_nope +
qk_rope`` dims and values of ``v_head_dim``: K != V). A hybrid model's recurrent layers
(mlx-lm's ``ArraysCache``: a convolution window and an SSM or delta-rule state) keep no
keys and values; their spec is the shapes of their state.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

#: One array of a recurrent layer's state: its shape without the batch axis, and its dtype.
StateArray = tuple[tuple[int, ...], str]


@dataclass(frozen=True, slots=True)
class LayerSpec:
    kv_heads: int
    k_head_dim: int
    v_head_dim: int
    window: int | None  # None: full attention; else the sliding-window size in tokens
    #: A recurrent layer (no keys and values; ``kv_heads`` 0): its state's arrays, in the
    #: order of mlx-lm's ``ArraysCache`` entries. None: an attention layer.
    state: tuple[StateArray, ...] | None = None
    #: Chunked attention (Llama 4's ``ChunkedKVCache``): a query sees the keys of its own
    #: ``chunk``-token chunk only. None: not chunked.
    chunk: int | None = None

    @property
    def sliding(self) -> bool:
        return self.window is not None

    @property
    def recurrent(self) -> bool:
        return self.state is not None

    def to_dict(self) -> dict[str, Any]:
        """As hashed into the model fingerprint: an attention layer's entry is the same as
        before recurrent layers existed (their caches keep their fingerprints)."""
        out = {"kv_heads": self.kv_heads, "k_head_dim": self.k_head_dim, "v_head_dim": self.v_head_dim}
        out["window"] = self.window
        if self.state is not None:
            out["state"] = [[list(shape), dtype] for shape, dtype in self.state]
        if self.chunk is not None:
            out["chunk"] = self.chunk
        return out


@dataclass(frozen=True, slots=True)
class ModelCacheSpec:
    layers: tuple[LayerSpec, ...]
    dtype: str  # float type of the model's activations ("float32", "bfloat16", ...)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def hybrid(self) -> bool:
        """Whether some layers keep a recurrent state (snapshotted, ``kv.recurrent``)."""
        return any(s.recurrent for s in self.layers)

    def fp16_bytes_per_token(self) -> int:
        """Bytes one token's K and V take in all layers at 16 bits (the reference size)."""
        return sum(2 * s.kv_heads * (s.k_head_dim + s.v_head_dim) for s in self.layers)

    def to_json(self) -> str:
        return json.dumps({"dtype": self.dtype, "layers": [s.to_dict() for s in self.layers]}, sort_keys=True)

    def digest(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()
