"""Two (or more) source trees side by side: the one harness of ``revisions.py`` (CPU speed)
and ``gpu_sliding.py`` (sliding layers on a GPU). Each measurement runs in a process of its
own with that tree's package first on the path and prints one JSON object last; rounds
alternate which tree goes first (this machine is shared and noisy: only ratios measured in
one interleaved run count)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any


def run_in_tree(tree: Path | str, args: Sequence[str]) -> dict[str, Any]:
    """``python args...`` in ``tree`` with its package first on the path: the JSON object
    its last line prints. A failed run raises with the end of its stderr."""
    tree = Path(tree)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(
        [sys.executable, *args], cwd=tree, env=env, capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise RuntimeError(f"{tree}: {' '.join(args[:2])} failed\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def interleaved(
    trees: Sequence[str],
    cells: Iterable[Any],
    rounds: int,
    measure: Callable[[str, Any], dict[str, Any]],
    on_row: Callable[[dict[str, Any]], None] = lambda row: None,
) -> list[dict[str, Any]]:
    """``measure(tree, cell)`` for every cell, tree and round; each round reverses which tree
    goes first. Rows: ``{"tree", "cell", "round", **measured}``; ``on_row`` sees each (to
    save partial results and show progress); a failed measurement is reported and skipped."""
    rows: list[dict[str, Any]] = []
    cells = list(cells)
    for r in range(rounds):
        order = list(trees) if r % 2 == 0 else list(trees)[::-1]
        for cell in cells:
            for tree in order:
                try:
                    row = {"tree": tree, "cell": cell, "round": r, **measure(tree, cell)}
                except RuntimeError as exc:
                    print(exc, file=sys.stderr)
                    continue
                rows.append(row)
                on_row(row)
    return rows


def medians(
    rows: Sequence[dict[str, Any]], metrics: Iterable[str]
) -> dict[tuple[str, Any], dict[str, float]]:
    """(tree, cell) -> the median of each metric over the rounds."""
    metrics = list(metrics)
    cells: dict[tuple[str, Any], list[dict[str, Any]]] = {}
    for row in rows:
        cells.setdefault((row["tree"], _key(row["cell"])), []).append(row)
    return {key: {m: statistics.median(r[m] for r in group) for m in metrics} for key, group in cells.items()}


def _key(cell: Any) -> Any:
    return tuple(cell) if isinstance(cell, list) else cell
