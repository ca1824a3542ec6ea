"""The code base stays ruff clean (lint and format), checked in CI with the tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_check() -> None:
    out = subprocess.run([sys.executable, "-m", "ruff", "check", str(ROOT)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_ruff_format() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", str(ROOT)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
