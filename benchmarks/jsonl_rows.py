"""One JSON object per line, printed and appended to ``$OUT/<file>`` where ``OUT`` is set:
what the device scripts (``gpu_probe.py``, ``restore_profile.py``) leave for the caller to
fetch, a line at a time, so a run cut by its time limit keeps what it measured."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def emitter(file: str) -> Any:
    """A function of keyword fields that prints them as one JSON line and appends the line
    to ``$OUT/file``."""

    def emit(**row: Any) -> None:
        line = json.dumps(row)
        print(line, flush=True)
        out = os.environ.get("OUT")
        if out:
            with open(Path(out) / file, "a") as f:
                f.write(line + "\n")

    return emit
