"""The soak (``benchmarks/soak.py``) for 75 seconds (its long run is twenty minutes): three
server workers on one shared store (real PostgreSQL and SeaweedFS) under clients and faults
(workers SIGKILLed and SIGSTOPped, each service SIGSTOPped, a full disk), every invariant of
the long run checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


def test_a_soak_of_clients_and_faults_breaks_no_invariant(tmp_path: Path, figures: dict[str, str]) -> None:
    args = ["--minutes", "1.25", "--clients", "4", "--agents", "6", "--fault-every", "9", "--freeze-s", "4"]
    done = subprocess.run(
        [sys.executable, str(SOAK), *args, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert (tmp_path / "soak.json").exists(), done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads((tmp_path / "soak.json").read_text())
    assert data["wrong"] == [], data["wrong"]
    assert done.returncode == 0, done.stdout[-3000:]
    checks = data["checks"]
    assert checks["dangling references"] == 0 and checks["acknowledged turns lost"] == 0
    assert checks["agents checked"] >= 3 and data["counts"].get("turn 200", 0) >= 10
    faults = {f["kind"] for f in data["faults"]}
    assert len(data["faults"]) >= 5, data["faults"]
    figures["soak (75 s)"] = (
        f"{data['counts'].get('turn 200', 0)} turns, {len(data['faults'])} faults "
        f"({', '.join(sorted(faults))}), {checks['agents checked']} agents resumed "
        f"{checks['resumed at the end']}, 0 lost, 0 dangling"
    )
