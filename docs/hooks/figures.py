"""MkDocs hook: the README's figures on the site without a second copy in git. Each plot
named here is served from ``benchmarks/results/`` as ``figures/{name}``, so pages (the
home page shows the README's figure) link to it as if it lived in ``docs/``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
FIGURES = ("gpu.png", "ttft.png", "graph_eviction.png", "fanout.png", "restore.png")


def on_files(files: Files, config: Any) -> Files:
    for name in FIGURES:
        if (RESULTS / name).exists():
            files.append(File.generated(config, f"figures/{name}", abs_src_path=str(RESULTS / name)))
    return files
