"""The model families agent-memory refuses, and why: the rest is decided by structure.

Whether the engine runs a model is decided from the loaded model (``structure``: the kinds
of its caches) and checked on it (``self_check``: the engine's logits against mlx-lm's own),
not from a list of names. This table only answers early, before any weight is read, for the
families the test matrix (tests/integration/test_model_matrix.py) found refused on every
config: the same verdict the structure or the self-check would give, with its reason.
"""

from __future__ import annotations

import json
from pathlib import Path

from .structure import UnsupportedModelError

#: config.json ``model_type`` -> why agent-memory refuses it.
REFUSED: dict[str, str] = {}

__all__ = ["REFUSED", "UnsupportedModelError", "check_refused", "model_type"]


def model_type(model_dir: Path) -> str:
    """The ``model_type`` of an mlx-lm model directory."""
    config = json.loads((model_dir / "config.json").read_text())
    return str(config.get("model_type", ""))


def check_refused(model_dir: Path) -> None:
    """``UnsupportedModelError`` with the reason when the directory's family is one the
    engine refuses (``REFUSED``)."""
    family = model_type(model_dir)
    if family in REFUSED:
        raise UnsupportedModelError(f"{model_dir}: model family {family!r} is refused: {REFUSED[family]}")
