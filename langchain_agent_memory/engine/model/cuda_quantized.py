"""Quantized checkpoints on CUDA: more than one row through the dequantized weight.

mlx 0.32.4's CUDA ``quantized_matmul`` did not return for more than one row of input on
the H100 (benchmarks/README, "quantized checkpoints on CUDA"; ``gpu_users.py``'s ``qmm``
part, plain mlx in a process of its own per shape): affine 4- and 8-bit weights of 64x64
and 64x256 with 8 or 300 rows ran past 30 s, where one row returned at once; mxfp4 returned
for 8 and 300 rows at 64x64 but not for 300 rows at 64x256. A checkpoint's prefill, and a
batched decode (a row per agent), multiply many rows: plain mlx-lm's first forward of
mlx-community's 4-bit Llama never ended, and the engine's test of it raised
``an illegal memory access was encountered`` (the issue's H100).

On CUDA, the loaded model's quantized linear layers and tied quantized embeddings (this
instance's modules: no class of mlx's is changed) multiply more than one row through their
weight dequantized for the call (``mx.dequantize``, then a plain matmul: one layer's weight
at 16 bits, transient). One row (a decode step alone) keeps mlx's quantized kernel, which
returned for every shape measured. MoE experts (``gather_qmm``) are not covered: not
measured apart from the whole forward.
"""

from __future__ import annotations

from typing import Any

import mlx.nn as nn

from ..ops.runtime import mx
from .adapters import switch_instance_class


def _rows(x: mx.array) -> int:
    return x.size // x.shape[-1] if x.ndim else 1


def _dequantized_product(module: Any, x: mx.array) -> mx.array:
    """``x @ W.T`` for the module's quantized ``W``, through ``W`` at ``x``'s precision."""
    w = mx.dequantize(
        module["weight"],
        module["scales"],
        module.get("biases"),
        group_size=module.group_size,
        bits=module.bits,
        mode=module.mode,
    )
    return x @ w.astype(x.dtype).T


class RowsDequantizedLinear(nn.QuantizedLinear):
    """A ``QuantizedLinear`` whose calls of more than one row multiply the dequantized weight."""

    def __call__(self, x: mx.array) -> mx.array:
        if _rows(x) <= 1:
            return super().__call__(x)
        y = _dequantized_product(self, x)
        return y + self["bias"] if "bias" in self else y


class RowsDequantizedEmbedding(nn.QuantizedEmbedding):
    """A ``QuantizedEmbedding`` whose output projection (``as_linear``, tied weights) of more
    than one row multiplies the dequantized weight."""

    def as_linear(self, x: mx.array) -> mx.array:
        if _rows(x) <= 1:
            return super().as_linear(x)
        return _dequantized_product(self, x)


_SWAPS: dict[type, type] = {
    nn.QuantizedLinear: RowsDequantizedLinear,
    nn.QuantizedEmbedding: RowsDequantizedEmbedding,
}


def dequantize_rows(model: Any) -> int:
    """Make ``model``'s quantized linear layers and embeddings multiply more than one row
    through their dequantized weights (above); returns how many modules were changed. Only
    modules of exactly mlx's classes change (a subclass of a family's own keeps its call)."""
    changed = 0
    for _, module in model.named_modules():
        swap = _SWAPS.get(type(module))
        if swap is not None:
            switch_instance_class(module, swap)
            changed += 1
    return changed


def needed() -> bool:
    """Whether this process runs mlx on CUDA, whose multi-row quantized matmul is avoided."""
    return mx.default_device().type == mx.DeviceType.gpu and mx.cuda.is_available()
