"""Which mlx-lm model families the engine runs, and a clear refusal for the others.

A family is supported when its layers keep keys and values (the engine stores those) and
the whole engine (4-bit persistence, EXACT / EXTEND / DIVERGE, batched decode, reload) has
been shown to give the uninterrupted output on it (tests/integration/test_families.py).
Hybrid families, whose recurrent layers keep a state instead, run through
``kv.recurrent`` (state snapshots, ``engine.states``); those that run a recurrent mixer and
attention inside one layer (Falcon-H1: mlx-lm's ``CacheList``) and pure state-space models
are refused.
"""

from __future__ import annotations

import json
from pathlib import Path

#: config.json ``model_type`` -> what it stands for.
SUPPORTED_FAMILIES: dict[str, str] = {
    "llama": "Llama 2 / 3.x, SmolLM2 (GQA)",
    "mistral": "Mistral (llama architecture)",
    "qwen2": "Qwen 2 / 2.5 (q/k/v biases)",
    "qwen3": "Qwen 3 (q/k norms)",
    "gemma3_text": "Gemma 3 text (sliding window)",
    "phi3": "Phi-3 / Phi-4 (fused qkv)",
    "gpt_oss": "gpt-oss (attention sinks, sliding window, MoE)",
    "deepseek_v2": "DeepSeek-V2 (MLA, K and V of different widths)",
    "deepseek_v3": "DeepSeek-V3 / R1 (MLA over a stored latent)",
    "qwen3_next": "Qwen3-Next (hybrid: Gated DeltaNet + attention, MoE)",
    "qwen3_5": "Qwen 3.5 (hybrid: Gated DeltaNet + attention)",
    "lfm2": "Liquid LFM2 (hybrid: short convolutions + attention)",
    "granitemoehybrid": "IBM Granite 4.0-H (hybrid: Mamba-2 + attention, MoE)",
    "lfm2_moe": "Liquid LFM2-MoE (hybrid: short convolutions + attention, MoE)",
    "kimi_linear": "Kimi Linear (hybrid: Kimi delta attention + MLA, MoE)",
    "nemotron_h": "NVIDIA Nemotron-H (hybrid: Mamba-2 + attention)",
}

#: Families whose layers keep a recurrent state (SSM, linear attention) besides or instead
#: of keys and values.
RECURRENT_FAMILIES = frozenset(
    {
        "qwen3_5",
        "qwen3_next",
        "nemotron_h",
        "falcon_h1",
        "lfm2",
        "mamba",
        "mamba2",
        "jamba",
        "recurrent_gemma",
        "granitemoehybrid",
        "plamo2",
        "rwkv7",
    }
)


class UnsupportedModelError(ValueError):
    """The model's family is not one the engine can store caches for."""


def model_type(model_dir: Path) -> str:
    """The ``model_type`` of an mlx-lm model directory."""
    config = json.loads((model_dir / "config.json").read_text())
    return str(config.get("model_type", ""))


def check_family(model_dir: Path) -> str:
    """The directory's model family, or ``UnsupportedModelError`` naming the supported ones."""
    family = model_type(model_dir)
    if family in SUPPORTED_FAMILIES:
        return family
    supported = ", ".join(sorted(SUPPORTED_FAMILIES))
    if family in RECURRENT_FAMILIES:
        raise UnsupportedModelError(
            f"{model_dir}: model family {family!r} keeps a recurrent state in a way agent-memory "
            f"cannot store yet (hybrids with separate recurrent and attention layers can). "
            f"Supported families: {supported}"
        )
    raise UnsupportedModelError(
        f"{model_dir}: model family {family or '(no model_type in config.json)'!r} is not supported "
        f"by agent-memory. Supported families: {supported}"
    )
