"""What the test matrix found about each of mlx-lm's model families, and the families
refused before any weight is read.

Whether the engine runs a model is decided from the loaded model (``structure``: the kinds
of its caches) and checked on it (``self_check``: the engine's logits against mlx-lm's own),
not from a list of names. ``family_verdicts.json`` records what the test matrix
(``testing.model_matrix``) found for every family of the mlx-lm it ran on: the caches of a
small config of it and the verdict, for ``agent-memory models`` and the docs' table; it
decides nothing. ``REFUSED`` answers early for families whose every config is refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .structure import UnsupportedModelError

#: config.json ``model_type`` -> why agent-memory refuses it, whatever the config.
REFUSED: dict[str, str] = {}

#: The test matrix's verdicts (``testing.model_matrix`` writes it).
VERDICTS_FILE = Path(__file__).with_name("family_verdicts.json")

__all__ = [
    "REFUSED",
    "VERDICTS_FILE",
    "UnsupportedModelError",
    "check_refused",
    "model_type",
    "recorded_verdicts",
]


def recorded_verdicts() -> dict[str, Any]:
    """``{"mlx_lm": version, "families": {family: {"kinds", "verdict", "reason"}}}`` as the
    test matrix recorded them (empty families if the file is missing)."""
    try:
        return json.loads(VERDICTS_FILE.read_text())
    except (OSError, ValueError):
        return {"mlx_lm": "?", "families": {}}


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
